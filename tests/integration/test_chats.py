"""Chats kept server-side: real API in a thread, real Postgres, a real tiny-model worker."""

from __future__ import annotations

from typing import Any

import requests

from tests import farm
from tests.integration.test_jobs import CHAT, submit_ok, wait_final


def call(method: str, url: str, token: str | None, **kwargs: Any) -> requests.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, url, headers=headers, timeout=30, **kwargs)


def new_chat(api_url: str, token: str, **fields: Any) -> dict[str, Any]:
    r = call("POST", f"{api_url}/v1/chats", token, json=fields)
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_chat_lifecycle_list_rename_delete(api_url: str, user_token: str) -> None:
    chat = new_chat(
        api_url,
        user_token,
        model="tiny-random",
        system_prompt="Be brief.",
        params={"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 40},
    )
    assert chat["title"] == "" and chat["messages"] == []
    assert chat["params"] == {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 40}

    r = call("PATCH", f"{api_url}/v1/chats/{chat['id']}", user_token, json={"title": "Foxes"})
    assert r.status_code == 200, r.text
    assert r.json()["title"] == "Foxes"
    assert r.json()["system_prompt"] == "Be brief."  # fields not sent are kept

    listed = call("GET", f"{api_url}/v1/chats", user_token).json()["data"]
    assert chat["id"] in [c["id"] for c in listed]
    assert next(c for c in listed if c["id"] == chat["id"])["title"] == "Foxes"

    assert call("DELETE", f"{api_url}/v1/chats/{chat['id']}", user_token).status_code == 204
    assert call("GET", f"{api_url}/v1/chats/{chat['id']}", user_token).status_code == 404
    listed = call("GET", f"{api_url}/v1/chats", user_token).json()["data"]
    assert chat["id"] not in [c["id"] for c in listed]


def test_first_user_message_titles_the_chat(api_url: str, user_token: str) -> None:
    chat = new_chat(api_url, user_token)
    r = call(
        "POST",
        f"{api_url}/v1/chats/{chat['id']}/messages",
        user_token,
        json={"role": "user", "content": "How do   foxes hunt in snow?"},
    )
    assert r.status_code == 201, r.text
    got = call("GET", f"{api_url}/v1/chats/{chat['id']}", user_token).json()
    assert got["title"] == "How do foxes hunt in snow?"
    assert [(m["role"], m["content"]) for m in got["messages"]] == [
        ("user", "How do   foxes hunt in snow?")
    ]


def test_a_user_sees_only_their_own_chats(
    api_url: str, user_token: str, other_user_token: str
) -> None:
    chat = new_chat(api_url, user_token, title="mine")
    base = f"{api_url}/v1/chats/{chat['id']}"
    assert call("GET", base, other_user_token).status_code == 404
    assert call("PATCH", base, other_user_token, json={"title": "x"}).status_code == 404
    r = call("POST", base + "/messages", other_user_token, json={"role": "user", "content": "hi"})
    assert r.status_code == 404
    assert call("DELETE", base, other_user_token).status_code == 404
    others = call("GET", f"{api_url}/v1/chats", other_user_token).json()["data"]
    assert chat["id"] not in [c["id"] for c in others]
    assert call("GET", base, user_token).json()["title"] == "mine"


def test_chats_need_a_valid_token(api_url: str) -> None:
    r = call("GET", f"{api_url}/v1/chats", None)
    assert r.status_code == 401
    assert r.json()["error_type"] == "unauthorized"
    r = call("GET", f"{api_url}/v1/chats", "sy_not-a-token")
    assert r.status_code == 401
    assert "invalid" in r.json()["error"]


def test_bad_fields_are_named(api_url: str, user_token: str) -> None:
    r = call("POST", f"{api_url}/v1/chats", user_token, json={"params": {"temperature": 9}})
    assert r.status_code == 422 and r.json()["field"] == "params.temperature"
    r = call("POST", f"{api_url}/v1/chats", user_token, json={"model": "no-such-model"})
    assert r.status_code == 404 and r.json()["field"] == "model"
    chat = new_chat(api_url, user_token)
    r = call(
        "POST",
        f"{api_url}/v1/chats/{chat['id']}/messages",
        user_token,
        json={"role": "assistant", "content": "no job"},
    )
    assert r.status_code == 422


def test_assistant_turn_takes_its_jobs_output(
    api_url: str, user_token: str, other_user_token: str, tiny_worker: farm.Process
) -> None:
    chat = new_chat(api_url, user_token, model="tiny-random")
    base = f"{api_url}/v1/chats/{chat['id']}"
    call(
        "POST", base + "/messages", user_token, json={"role": "user", "content": CHAT[0]["content"]}
    )
    job_id = submit_ok(api_url, user_token)

    theirs = submit_ok(api_url, other_user_token)
    r = call("POST", base + "/messages", user_token, json={"role": "assistant", "job_id": theirs})
    assert r.status_code == 422 and r.json()["field"] == "job_id"

    r = call("POST", base + "/messages", user_token, json={"role": "assistant", "job_id": job_id})
    assert r.status_code == 201, r.text
    message_id = r.json()["id"]
    job = wait_final(api_url, user_token, job_id)
    assert job["status"] == "succeeded" and job["output_text"]

    got = call("GET", base, user_token).json()
    assistant = got["messages"][-1]
    assert assistant["role"] == "assistant" and assistant["job_id"] == job_id
    assert assistant["content"] == job["output_text"]
    assert assistant["job"]["status"] == "succeeded"
    one = call("GET", f"{base}/messages/{message_id}", user_token).json()
    assert one["content"] == job["output_text"] and one["job"]["queue_position"] is None


def test_queued_turn_shows_its_queue_position(api_url: str, user_token: str) -> None:
    # tiny-late has no worker in this test, so its jobs wait in the queue.
    chat = new_chat(api_url, user_token, model="tiny-late")
    base = f"{api_url}/v1/chats/{chat['id']}"
    first = submit_ok(api_url, user_token, model="tiny-late")
    second = submit_ok(api_url, user_token, model="tiny-late")
    try:
        ids = []
        for job_id in (first, second):
            r = call(
                "POST", base + "/messages", user_token, json={"role": "assistant", "job_id": job_id}
            )
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        positions = [
            call("GET", f"{base}/messages/{i}", user_token).json()["job"]["queue_position"]
            for i in ids
        ]
        assert positions[1] == positions[0] + 1
        assert positions[0] >= 0
    finally:
        for job_id in (first, second):
            call("DELETE", f"{api_url}/v1/jobs/{job_id}", user_token)
    got = call("GET", base, user_token).json()
    assert [m["job"]["status"] for m in got["messages"]] == ["cancelled", "cancelled"]
    assert all(m["job"]["queue_position"] is None for m in got["messages"])
