"""A test server over raw sockets and HTTP: its address, what it writes before it closes, its status
and OpenAI error body, an API key, a request schema's unbounded places, a token's bytes
(test_server_hostile's, test_server_hardening's, test_sampling_options_server's)."""
from __future__ import annotations

import json
import socket
import time

import httpx

from support.server import Server
from tiny_tokenizer import byte_symbols


def address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed_within(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server writes until it closes the connection, or None if it is still open after
    `timeout` seconds."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def answer(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """closed_within, and when it closed (seconds from now); still open fails the test."""
    start = time.monotonic()
    data = closed_within(sock, timeout)
    assert data is not None, f"the connection was still open after {timeout} s"
    return data, time.monotonic() - start


def status_and_error(data: bytes) -> tuple[int, dict, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return int(lines[0].split()[1]), headers, error


def unbounded(schema: dict, components: dict, path: str = "", seen: frozenset = frozenset()) -> list[str]:
    """The places in a request schema where a string, array or object has no bound."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return [] if name in seen else unbounded(components[name], components, path, seen | {name})
    if "enum" in schema or "const" in schema:
        return []
    found = []
    kind = schema.get("type")
    if kind == "string" and "maxLength" not in schema:
        found.append(path)
    if kind == "array" and "maxItems" not in schema:
        found.append(path)
    if kind == "object" and schema.get("additionalProperties", False) is not False and "maxProperties" not in schema:
        found.append(path)
    for key in ("anyOf", "oneOf", "allOf"):
        for i, form in enumerate(schema.get(key, [])):
            found += unbounded(form, components, f"{path}|{i}", seen)
    for name, field in schema.get("properties", {}).items():
        found += unbounded(field, components, f"{path}.{name}", seen)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found += unbounded(schema[key], components, f"{path}[]", seen)
    return found


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI error body of a response that must have `status`."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


KEY = "qd-test-key"


def token_bytes(llm, ids: list[int]) -> list[bytes]:
    """Each token's bytes by the tiny tokenizer's own table (ids past its vocabulary, which the model's
    embedding rows still have, are no text: b"")."""
    value = {symbol: b for b, symbol in enumerate(byte_symbols())}
    return [b"" if piece is None else bytes(value[c] for c in piece)
            for piece in llm.tokenizer.hf.convert_ids_to_tokens(ids)]
