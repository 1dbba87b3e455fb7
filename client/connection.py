"""A connection to a Switchyard API over HTTP and websockets, as any client sees it.

This package is a client of the public API: it imports nothing from the
server's packages, so it works against a farm on another machine. Every
failure becomes a :class:`ClientError` whose message a person can act on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
import websocket

# Seconds to wait for the API to answer one HTTP request.
HTTP_TIMEOUT_S = 30.0
# Seconds a websocket read may stay silent before the stream is re-opened.
STREAM_IDLE_S = 120.0
NO_JOB = "00000000-0000-0000-0000-000000000000"


class ClientError(Exception):
    """Something the user must fix or know: a bad URL, token, model, or a failed job."""

    def __init__(self, message: str, *, status: int | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


@dataclass(frozen=True)
class Model:
    """One entry of ``GET /v1/models``."""

    name: str
    public: bool
    ready: int
    max_new_tokens: int | None
    description: str = ""


@dataclass
class Event:
    """One event of a job's stream (``seq``, ``type`` and the type's fields)."""

    seq: int
    type: str
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return str(self.fields.get("text", ""))

    @property
    def final(self) -> bool:
        return self.type in ("done", "error")

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, **self.fields}


def normalize_url(url: str) -> str:
    """``host:port`` or a full URL, without a trailing slash; raises on nonsense."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ClientError(f"{url!r} is not an http(s) URL of a Switchyard API")
    return url


class Connection:
    """HTTP calls and job streams against one API with one (optional) token."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        self.base_url = normalize_url(base_url)
        self.token = token or None
        self.http = requests.Session()
        if self.token:
            self.http.headers["Authorization"] = f"Bearer {self.token}"

    # ------------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Call the API; the JSON body, or :class:`ClientError` in plain words."""
        url = self.base_url + path
        try:
            response = self.http.request(method, url, json=body, timeout=HTTP_TIMEOUT_S)
        except requests.ConnectionError:
            raise ClientError(
                f"cannot reach Switchyard at {self.base_url}: nothing answers there "
                "(is the farm running? check --url)"
            ) from None
        except requests.Timeout:
            raise ClientError(f"{self.base_url} did not answer in {HTTP_TIMEOUT_S:.0f} s") from None
        except requests.RequestException as exc:
            raise ClientError(f"cannot talk to {self.base_url}: {exc}") from None
        try:
            data = response.json() if response.content else None
        except ValueError:
            data = None
        if response.ok:
            if data is None and response.content:
                raise ClientError(self._not_switchyard(path, response))
            return data
        if not isinstance(data, dict) or "error" not in data:
            raise ClientError(self._not_switchyard(path, response), status=response.status_code)
        raise self._api_error(response.status_code, data, response.headers.get("Retry-After"))

    def _not_switchyard(self, path: str, response: requests.Response) -> str:
        kind = response.headers.get("Content-Type", "no content type").split(";")[0]
        return (
            f"{self.base_url} does not look like a Switchyard API: "
            f"{path} answered {response.status_code} ({kind})"
        )

    def _api_error(self, status: int, body: dict[str, Any], retry_after: str | None) -> ClientError:
        detail = str(body.get("error", ""))
        kind = str(body.get("error_type", ""))
        if status == 401:
            if self.token:
                message = f"the API token was refused: {detail}"
            else:
                message = f"{detail}: pass --token or set SY_TOKEN"
        elif status == 403:
            message = f"not allowed: {detail}"
        elif status == 429:
            wait = f"; retry in {retry_after} s" if retry_after else "; retry shortly"
            message = f"too many requests: {detail}{wait}"
        elif status == 503:
            message = f"the farm is unavailable: {detail}"
        else:
            message = detail or f"HTTP {status}"
        return ClientError(message, status=status, kind=kind)

    def models(self) -> list[Model]:
        """The served models (enabled ones only)."""
        body = self.request("GET", "/v1/models")
        if not isinstance(body, dict) or not isinstance(body.get("data"), list):
            raise ClientError(f"{self.base_url} does not look like a Switchyard API (/v1/models)")
        found = []
        for entry in body["data"]:
            if entry.get("enabled") is False:
                continue
            state = entry.get("state") or {}
            limits = entry.get("limits") or {}
            found.append(
                Model(
                    name=str(entry["id"]),
                    public=bool(entry.get("public", True)),
                    ready=int(state.get("replicas_ready", 0)),
                    max_new_tokens=limits.get("max_new_tokens"),
                    description=str(entry.get("description") or ""),
                )
            )
        return found

    def check_token(self) -> None:
        """Raise :class:`ClientError` now if the token is refused (before any prompt)."""
        if not self.token:
            return
        # Reading a job no one has checks the token first (401) and only then
        # finds nothing (404): the cheapest authenticated call every API has.
        try:
            self.request("GET", f"/v1/jobs/{NO_JOB}")
        except ClientError as exc:
            if exc.status != 404:
                raise

    def submit(self, model: str, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
        """Queue a generation; its job id."""
        body = self.request(
            "POST", "/v1/jobs", {"model": model, "messages": messages, "params": params}
        )
        return str(body["id"])

    def cancel(self, job_id: str) -> None:
        """Ask the farm to stop a job (queued: at once; running: at its next step)."""
        self.request("DELETE", f"/v1/jobs/{job_id}")

    def job(self, job_id: str) -> dict[str, Any]:
        body = self.request("GET", f"/v1/jobs/{job_id}")
        return dict(body)

    # ------------------------------------------------------------------ streams

    def events(self, job_id: str, after: int = -1) -> Iterator[Event]:
        """Every event of a job with ``seq > after``, in order, through its websocket.

        Ends after ``done`` or ``error``. A dropped connection is re-opened from
        the last seq seen, so no event is lost or repeated. While the job waits
        for a worker that is starting, ``waiting`` events (seq -1: not in the
        job's log) say how far along it is (docs/api.md).
        """
        last = after
        for _attempt in range(5):
            try:
                for event in self._socket_events(job_id, last):
                    if event.type != "waiting":
                        last = event.seq
                    yield event
                    if event.final:
                        return
            except (websocket.WebSocketException, OSError):
                continue
        raise ClientError(f"lost the stream of job {job_id}; see GET /v1/jobs/{job_id}")

    def _socket_events(self, job_id: str, after: int) -> Iterator[Event]:
        scheme = "wss" if self.base_url.startswith("https") else "ws"
        url = f"{scheme}{self.base_url[self.base_url.index('://') :]}/v1/jobs/{job_id}/ws"
        url += "?waiting=1" + (f"&after={after}" if after >= 0 else "")
        headers = [f"Authorization: Bearer {self.token}"] if self.token else []
        ws = websocket.create_connection(url, header=headers, timeout=STREAM_IDLE_S)
        try:
            while True:
                raw = ws.recv()
                if not raw:
                    return
                data = json.loads(raw)
                if "seq" not in data and data.get("type") == "waiting":
                    yield Event(seq=-1, type=str(data.pop("type")), fields=data)
                    continue
                if "seq" not in data:  # a refusal frame: {"type": "error", "error", "status"}
                    raise self._api_error(int(data.get("status", 500)), data, None)
                seq = int(data.pop("seq"))
                kind = str(data.pop("type"))
                yield Event(seq=seq, type=kind, fields=data)
        finally:
            ws.close()
