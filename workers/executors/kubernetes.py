"""The Kubernetes executor: sets the replica count of each model's worker Deployment.

It patches the Deployment's ``scale`` subresource (apps/v1) through the
official ``kubernetes`` client, which needs RBAC on ``deployments/scale``
only (see ``docker/k8s/scaler.yaml``). A patch is sent only when the
Deployment's ``spec.replicas`` differs from the wanted count, so a steady farm
costs one GET per model per tick. Draining is Kubernetes' own: a pod being
removed gets SIGTERM (Celery's warm shutdown) and
``terminationGracePeriodSeconds`` to finish its jobs before SIGKILL.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from config import Settings
from workers.executors.base import ExecutorError

log = logging.getLogger(__name__)


def deployment_name(settings: Settings, model: str) -> str:
    """The Deployment of ``model``'s workers (a DNS-1123 name: no underscores)."""
    name = settings.k8s_deployment.format(model=model).lower()
    return re.sub(r"[^a-z0-9.-]", "-", name)[:253]


def default_api_client() -> Any:
    """An API client from the pod's service account, else from ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError) as exc:
            raise ExecutorError(
                f"no Kubernetes credentials: not in a pod, and no usable kubeconfig ({exc})"
            ) from None
    return client.ApiClient()


class KubernetesExecutor:
    """Applies replica counts to ``Deployment/<k8s_deployment>`` in ``k8s_namespace``."""

    name = "kubernetes"

    def __init__(self, settings: Settings, api_client: Any | None = None) -> None:
        from kubernetes import client

        self.settings = settings
        self.apps = client.AppsV1Api(api_client if api_client is not None else default_api_client())
        self._applied: dict[str, int] = {}

    def apply(self, model: str, replicas: int) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        name = deployment_name(self.settings, model)
        namespace = self.settings.k8s_namespace
        try:
            scale = self.apps.read_namespaced_deployment_scale(name, namespace)
            current = scale.spec.replicas if scale.spec is not None else None
            if current != replicas:
                self.apps.patch_namespaced_deployment_scale(
                    name, namespace, {"spec": {"replicas": replicas}}
                )
                log.info(
                    "scaled deployment %s/%s from %s to %d", namespace, name, current, replicas
                )
            self._applied[model] = replicas
        except ApiException as exc:
            raise ExecutorError(
                f"cannot scale deployment {namespace}/{name}: {exc.status} {exc.reason}"
            ) from None
        except (HTTPError, OSError) as exc:  # the API server is unreachable
            raise ExecutorError(f"cannot reach the Kubernetes API: {exc}") from None

    def poll(self) -> None:
        """Nothing to supervise: the Deployment controller restarts crashed pods."""

    def replicas(self) -> dict[str, int]:
        return dict(self._applied)

    def close(self) -> None:
        """Replicas stay as they are when the scaler stops; the next leader takes over."""
