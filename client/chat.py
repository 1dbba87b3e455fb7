"""``switchyard chat``: a terminal chat with a model of a running farm.

The REPL keeps the conversation in memory and sends all of it with each
prompt; tokens are printed as they arrive over the job's websocket. Ctrl-C
during an answer cancels the job (it ends ``cancelled``) and keeps what was
said so far; Ctrl-C at the prompt clears the line; Ctrl-D exits.

Commands: ``/model [NAME]``, ``/models``, ``/system [TEXT | -]``,
``/params [k=v ...| reset]``, ``/new``, ``/help``, ``/exit``.

``--prompt TEXT`` answers one prompt and exits (0 succeeded, 1 failed or
refused, 130 cancelled), for scripts; ``--json`` prints every stream event as
one JSON object per line instead of the bare text.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

from client.connection import ClientError, Connection, Event, Model

DEFAULT_URL = "http://127.0.0.1:8000"
# The client's own variables. They are not SWITCHYARD_* on purpose: the
# server's settings refuse unknown SWITCHYARD_* names, and a user's shell
# exporting a client token must not stop a farm started from that shell.
URL_VARIABLE = "SY_URL"
TOKEN_VARIABLE = "SY_TOKEN"

PARAM_TYPES: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_new_tokens": int,
    "repetition_penalty": float,
    "seed": int,
}
PARAM_ALIASES = {"max_tokens": "max_new_tokens", "tokens": "max_new_tokens"}

HELP = """\
/model [NAME]        show the model, or switch to NAME
/models              list the models this farm serves
/system [TEXT | -]   show, set, or (with -) clear the system prompt
/params [k=v ...]    show or set sampling: temperature, top_p, top_k, max_new_tokens,
                     repetition_penalty, seed (k= unsets one; /params reset unsets all)
/new                 start a new conversation (model, system prompt and params stay)
/help                this text
/exit                leave (or Ctrl-D)
Ctrl-C during an answer cancels it."""


class Outcome(enum.Enum):
    succeeded = 0
    failed = 1
    cancelled = 130


@dataclass
class Conversation:
    """What the next prompt is sent with."""

    model: str
    system: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return [*head, *self.turns, {"role": "user", "content": prompt}]


def waiting_text(frame: dict[str, Any]) -> str:
    """Words for a ``waiting`` event: the job's model has no ready worker yet."""
    starting = int(frame.get("replicas_starting") or 0)
    if not starting:
        return "waiting for a worker of this model to be started"
    text = "a worker is" if starting == 1 else f"{starting} workers are"
    text += " loading the model"
    progress, eta = frame.get("progress"), frame.get("eta_s")
    if isinstance(progress, int | float):
        text += f": {progress:.0f}%"
    if isinstance(eta, int | float):
        text += f", about {eta:.0f} s left"
    return text


def parse_params(words: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """``params`` updated by ``k=v`` words; raises :class:`ClientError` naming a bad one."""
    updated = dict(params)
    for word in words:
        name, sep, raw = word.partition("=")
        name = PARAM_ALIASES.get(name.strip(), name.strip())
        if not sep or name not in PARAM_TYPES:
            known = ", ".join(PARAM_TYPES)
            raise ClientError(f"{word!r}: expected NAME=VALUE with NAME one of {known}")
        if raw.strip() == "":
            updated.pop(name, None)
            continue
        try:
            updated[name] = PARAM_TYPES[name](raw.strip())
        except ValueError:
            kind = "an integer" if PARAM_TYPES[name] is int else "a number"
            raise ClientError(f"{name}: {raw!r} is not {kind}") from None
    return updated


class ChatSession:
    """One terminal chat: a connection, a conversation, and where to print."""

    def __init__(
        self,
        conn: Connection,
        conversation: Conversation,
        models: list[Model],
        *,
        as_json: bool = False,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ) -> None:
        self.conn = conn
        self.conversation = conversation
        self.models = models
        self.as_json = as_json
        self.out = out
        self.err = err

    # ------------------------------------------------------------ one prompt

    def ask(self, prompt: str) -> Outcome:
        """Send ``prompt`` with the conversation, print the answer as it streams.

        The turn is kept in the conversation when it succeeded or was cancelled
        with some text; a refused or failed prompt leaves the conversation as it was.
        """
        conv = self.conversation
        try:
            job_id = self.conn.submit(conv.model, conv.messages(prompt), conv.params)
        except KeyboardInterrupt:
            self._note("cancelled before the prompt was sent")
            return Outcome.cancelled
        except ClientError as exc:
            self._error(exc.message)
            return Outcome.failed
        last = -1
        cancelling = False
        final: Event | None = None
        while final is None:
            try:
                for event in self.conn.events(job_id, after=last):
                    last = max(last, event.seq)
                    self._show(job_id, event)
                    if event.final:
                        final = event
            except KeyboardInterrupt:
                if cancelling:  # a second Ctrl-C: stop waiting for the cancel to land
                    self._note(f"stopped waiting; job {job_id} is being cancelled")
                    return Outcome.cancelled
                cancelling = True
                self._note("cancelling…")
                try:
                    self.conn.cancel(job_id)
                except ClientError as exc:
                    self._error(f"could not cancel job {job_id}: {exc.message}")
            except ClientError as exc:
                self._error(exc.message)
                return Outcome.failed
        return self._settle(prompt, final)

    def _settle(self, prompt: str, final: Event) -> Outcome:
        if final.type == "error":
            self._error(f"the job failed: {final.fields.get('error') or 'unknown error'}")
            return Outcome.failed
        reason = final.fields.get("finish_reason")
        text = final.text
        if text or reason != "cancelled":
            self.conversation.turns.append({"role": "user", "content": prompt})
            self.conversation.turns.append({"role": "assistant", "content": text})
        if reason == "cancelled":
            self._note("cancelled")
            return Outcome.cancelled
        if reason == "length":
            self._note("stopped at max_new_tokens; /params max_new_tokens=N for longer answers")
        return Outcome.succeeded

    def _show(self, job_id: str, event: Event) -> None:
        if self.as_json:
            self.out.write(json.dumps({"job_id": job_id, **event.as_dict()}) + "\n")
            self.out.flush()
            return
        if event.type == "waiting":
            self._note(waiting_text(event.fields))
        elif event.type == "token":
            self.out.write(event.text)
            self.out.flush()
        elif event.type == "restart":  # not "resumed": a resumed answer just goes on
            self._note("the answer could not be continued on another worker; it starts again")
        elif event.type == "done":
            self.out.write("\n")
            self.out.flush()

    def _note(self, message: str) -> None:
        self.err.write(f"\n[{message}]\n" if not self.as_json else f"[{message}]\n")
        self.err.flush()

    def _error(self, message: str) -> None:
        self.err.write(f"error: {message}\n")
        self.err.flush()

    # ------------------------------------------------------------ the REPL

    def command(self, line: str) -> bool:
        """Run a ``/command``; False when the REPL should end."""
        name, _, rest = line[1:].partition(" ")
        rest = rest.strip()
        conv = self.conversation
        if name in ("exit", "quit", "q"):
            return False
        if name == "help":
            self.err.write(HELP + "\n")
        elif name == "models":
            self.models = self.conn.models()
            for m in self.models:
                mark = "*" if m.name == conv.model else " "
                access = "public" if m.public else "token"
                self.err.write(f"{mark} {m.name}  ({m.ready} ready, {access})  {m.description}\n")
        elif name == "model":
            if not rest:
                self.err.write(f"model: {conv.model}\n")
            else:
                self.models = self.conn.models()
                conv.model = pick_model(rest, self.models, signed_in=bool(self.conn.token))
                self.err.write(f"model: {conv.model}\n")
        elif name == "system":
            if rest == "-":
                conv.system = ""
                self.err.write("system prompt cleared\n")
            elif rest:
                conv.system = rest
                self.err.write("system prompt set\n")
            else:
                self.err.write(f"system prompt: {conv.system or '(none)'}\n")
        elif name == "params":
            if rest == "reset":
                conv.params = {}
            elif rest:
                conv.params = parse_params(rest.split(), conv.params)
            shown = " ".join(f"{k}={v}" for k, v in conv.params.items()) or "(model defaults)"
            self.err.write(f"params: {shown}\n")
        elif name == "new":
            conv.turns.clear()
            self.err.write("new conversation\n")
        else:
            self.err.write(f"unknown command /{name}; /help lists them\n")
        self.err.flush()
        return True

    def repl(self, read: Any = input) -> int:
        """Read prompts until Ctrl-D or /exit."""
        self.err.write(
            f"Switchyard chat: {self.conversation.model} at {self.conn.base_url}\n"
            "Type a message; /help for commands; Ctrl-C stops an answer; Ctrl-D exits.\n"
        )
        self.err.flush()
        while True:
            try:
                line = read("you> ")
            except EOFError:
                self.err.write("\n")
                return 0
            except KeyboardInterrupt:
                self.err.write("\n")
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                try:
                    if not self.command(line):
                        return 0
                except ClientError as exc:
                    self._error(exc.message)
                continue
            self.ask(line)


def pick_model(wanted: str | None, models: list[Model], *, signed_in: bool = True) -> str:
    """``wanted`` if served; else (when none asked) the first model with a ready worker.

    Without a token the farm lists only its public models, so a model missing
    from the list may just need one: the message says so.
    """
    names = [m.name for m in models]
    hint = ""
    if not signed_in:
        hint = " (without a token only public models are listed: pass --token or set SY_TOKEN)"
    if not models:
        raise ClientError(f"this farm serves no model{hint}")
    if wanted is None:
        ready = [m.name for m in models if m.ready > 0]
        return (ready or names)[0]
    if wanted not in names:
        raise ClientError(f"unknown model {wanted!r}; this farm serves: {', '.join(names)}{hint}")
    return wanted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``switchyard chat``."""
    parser.add_argument("--model", "-m", help="model to chat with (default: one with a worker)")
    parser.add_argument(
        "--url",
        default=None,
        help=f"API base URL (default: ${URL_VARIABLE} or {DEFAULT_URL})",
    )
    parser.add_argument(
        "--token",
        default=None,
        help=f"API token (default: ${TOKEN_VARIABLE}; the variable keeps it out of `ps`)",
    )
    parser.add_argument("--system", default="", help="system prompt")
    parser.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="K=V",
        help="sampling parameter, e.g. temperature=0.2 (repeatable)",
    )
    parser.add_argument("--prompt", help="answer this one prompt and exit (for scripts)")
    parser.add_argument(
        "--json", action="store_true", help="print stream events as JSON lines instead of text"
    )


def run(args: argparse.Namespace, environ: dict[str, str] | None = None) -> int:
    """Run the chat the parsed ``args`` ask for; the process's exit status."""
    env = dict(os.environ if environ is None else environ)
    url = args.url or env.get(URL_VARIABLE) or DEFAULT_URL
    token = args.token or env.get(TOKEN_VARIABLE) or None
    try:
        conn = Connection(url, token)
        models = conn.models()
        conn.check_token()
        model = pick_model(args.model, models, signed_in=token is not None)
        params = parse_params(list(args.param), {})
    except ClientError as exc:
        print(f"switchyard chat: {exc.message}", file=sys.stderr)
        return 1
    session = ChatSession(
        conn,
        Conversation(model=model, system=args.system or "", params=params),
        models,
        as_json=args.json,
    )
    if args.prompt is not None:
        return session.ask(args.prompt).value
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    return session.repl()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchyard chat", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
