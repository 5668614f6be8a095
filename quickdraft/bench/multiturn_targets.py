"""The servers `quickdraft bench multiturn` measures, one at a time, each a process of its own on a
free 127.0.0.1 port with the same model file and threads: `quickdraft serve` with its prefix cache
(with --replicas N: N replicas on Ray, one target per router) and with `--no-prefix-cache`, and
llama.cpp's llama-server (`cache_prompt` in every request; every replica's threads) with as many
slots as sessions and with fewer. Each is started, waited for (/health), measured (quickdraft's
per-replica load from /metrics too), stopped.

Knows command lines and process lifetimes; the sessions are multiturn.py's.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from quickdraft.bench.llama_server import launch_command
from quickdraft.bench.multiturn import SessionPlan, TurnRecord, run_sessions
from quickdraft.cluster.load import ReplicaLoad, load_between, replica_loads
from quickdraft.errors import QuickdraftError

MODEL_NAME = "bench"  # the model id the clients send; quickdraft serves under it (llama-server takes any)
TARGET_NAMES = ("quickdraft", "no-cache", "llama-server")


@dataclass(frozen=True)
class Target:
    name: str
    engine: Literal["quickdraft", "llama-server"]
    prefix_cache: bool = True  # quickdraft's
    slots: int = 0             # llama-server's
    router: str = "prefix"     # quickdraft's, with replicas

    def request_fields(self) -> dict:
        """What this server's requests add to the chat body: llama-server keeps a slot's prompt
        only when asked (`cache_prompt`)."""
        return {"cache_prompt": True} if self.engine == "llama-server" else {}


@dataclass(frozen=True)
class ServerSettings:
    model: str                 # as quickdraft is given it: a packaged name or a path
    model_file: Path | None    # the GGUF file llama-server loads (None: not a GGUF model)
    threads: int
    sessions: int
    max_seq_len: int
    dtype: str = "float32"
    device: str = "cpu"
    spec: str = "none"
    k: int = 8
    prefix_cache_mb: int | None = None
    llama_cache_ram_mb: int | None = None
    replicas: int = 1          # quickdraft's, each of `threads` threads; llama-server gets them all


def parse_targets(names: str, llama_slots: Sequence[int], routers: Sequence[str] = ("prefix",)) -> list[Target]:
    """`names`: comma-separated TARGET_NAMES; llama-server stands for one target per slot count,
    quickdraft for one per router (named after it where there are several; the first is the base)."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in TARGET_NAMES]
    if unknown or not wanted:
        raise QuickdraftError(f"unknown target(s) {', '.join(unknown) or names!r}; expected a comma-separated "
                              f"list of {', '.join(TARGET_NAMES)}")
    targets = []
    for name in TARGET_NAMES:
        if name not in wanted:
            continue
        if name == "llama-server":
            targets += [Target(f"llama-server-{s}slot{'s' if s > 1 else ''}", "llama-server", slots=s)
                        for s in llama_slots]
        elif name == "quickdraft" and len(routers) > 1:
            targets += [Target(f"quickdraft-{r}", "quickdraft", router=r) for r in routers]
        else:
            targets.append(Target(name, "quickdraft", prefix_cache=name == "quickdraft", router=routers[0]))
    return targets


def quickdraft_command(s: ServerSettings, target: Target, port: int) -> list[str]:
    """`quickdraft serve` with a batch row per session; speculation as asked (none by default: the
    benchmark is about prefill), the start-up cost measurement only where a proposer uses it."""
    cmd = [sys.executable, "-m", "quickdraft", "serve", "--model", s.model, "--dtype", s.dtype, "--device", s.device,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--max-batch", str(s.sessions), "--max-seq-len", str(s.max_seq_len), "--threads", str(s.threads),
           "--spec", s.spec, "--log-level", "warning"]
    cmd += ["-k", str(s.k)] if s.spec != "none" else ["--no-measure-cost"]
    if not target.prefix_cache:
        cmd.append("--no-prefix-cache")
    elif s.prefix_cache_mb is not None:
        cmd += ["--prefix-cache-mb", str(s.prefix_cache_mb)]
    return cmd + (["--replicas", str(s.replicas), "--router", target.router] if s.replicas > 1 else [])


def llama_server_command(binary: Path, s: ServerSettings, target: Target, port: int) -> list[str]:
    """llama-server on the same file and threads (all replicas' together); its context split evenly
    between the slots, so each slot holds max_seq_len tokens."""
    if s.model_file is None:
        raise QuickdraftError(f"llama-server needs a GGUF file; {s.model!r} is not one")
    threads = str(s.threads * s.replicas)
    args = ["--model", str(s.model_file), "--threads", threads, "--threads-batch", threads,
            "--ctx-size", str(s.max_seq_len * target.slots), "--parallel", str(target.slots),
            "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_NAME]
    if s.llama_cache_ram_mb is not None:
        args += ["--cache-ram", str(s.llama_cache_ram_mb)]
    return launch_command(binary, args)


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS's pick; the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server process whose output goes to `log`; ready once GET /health answers 200."""

    def __init__(self, command: Sequence[str], port: int, env: dict[str, str], log: Path,
                 ready_timeout_s: float = 900.0) -> None:
        self.command, self.port, self.env, self.log = list(command), port, env, log
        self.url = f"http://127.0.0.1:{port}"
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise QuickdraftError(f"{Path(self.command[0]).name} exited with code {self.process.returncode} "
                                      f"before it was ready; its log ends:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise QuickdraftError(f"the server was not ready within {self.ready_timeout_s:.0f} s; its log ends:\n"
                              f"{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def warm_up(url: str, n: int) -> None:
    """`n` short raw completions at once before the timed sessions (kernels built, batched paths and
    pages touched); their prompts share no prefix with a chat template's, so they seed no cache the
    sessions could hit."""
    def one(i: int) -> None:
        prompt = f"Warm-up {i}: " + ", ".join(str(j) for j in range(i, i + 40))
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                     "temperature": 0}, timeout=600)
        if r.status_code != 200:
            raise QuickdraftError(f"a warm-up request got {r.status_code}: {r.text[:300]}")

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def server_info(target: Target, server: ServerProcess) -> dict:
    """What runs: quickdraft's /health (weights, kernel); llama-server's build and slots (/props),
    and whether ggml found AMX refused (its log says so)."""
    if target.engine == "quickdraft":
        return httpx.get(f"{server.url}/health", timeout=10).json()
    props = httpx.get(f"{server.url}/props", timeout=10).json()
    return {"build_info": props.get("build_info"), "total_slots": props.get("total_slots"),
            "amx_refused": "AMX is not ready" in server.log.read_text(errors="replace")}


def measure(target: Target, s: ServerSettings, plans: Sequence[SessionPlan], max_tokens: int, lead_session: bool,
            llama_binary: Path | None, env: dict[str, str], log_dir: Path, log: Callable[[str], None]) -> dict:
    """Start the target's server, warm it up, run every session against it, stop it; the run's
    records (as dicts), its wall seconds, command and what the server says it runs."""
    port = free_port()
    if target.engine == "llama-server":
        assert llama_binary is not None, "a llama-server target needs the binary"
        command = llama_server_command(llama_binary, s, target, port)
    else:
        command = quickdraft_command(s, target, port)
    log(f"{target.name}: starting {Path(command[0]).name} on port {port} (log: {log_dir / (target.name + '.log')})")
    body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0, **target.request_fields()}

    def on_turn(r: TurnRecord) -> None:
        cached = "?" if r.cached_tokens is None else f"{r.cached_tokens:,}"
        log(f"{target.name}: session {r.session} turn {r.turn}: TTFT {r.ttft_s:.2f} s, {r.prompt_tokens:,} prompt "
            f"tokens ({cached} cached), {r.completion_tokens} new in {r.total_s:.2f} s"
            f"{f' (replica {r.replica})' if r.replica else ''}")

    with ServerProcess(command, port, env, log_dir / f"{target.name}.log") as server:
        warm_up(server.url, len(plans))
        try:
            before = replica_load(target, server)
            with KVPeak(server.url) if target.engine == "quickdraft" else contextlib.nullcontext() as peak:
                wall, records = run_sessions(server.url, plans, body, lead_session, on_turn)
            replicas = {r: lo.as_dict() for r, lo in load_between(before, replica_load(target, server)).items()}
        except (httpx.HTTPError, RuntimeError, ValueError) as e:  # died, refused or garbled: which, and its log
            raise QuickdraftError(f"{target.name}: {type(e).__name__}: {e}; its log ends:\n"
                                  f"{server.log_tail()}") from None
        load = os.getloadavg()[0]  # the machine's 1-minute load as the run ends: its own threads and others'
        info = server_info(target, server)
    kv_peak_mib = None if peak is None or peak.block_bytes is None else peak.blocks * peak.block_bytes / 2**20
    log(f"{target.name}: {len(records)} turns in {wall:.1f} s"
        + ("" if kv_peak_mib is None else f", K/V held at most {kv_peak_mib:,.0f} MiB ({peak.blocks:,} blocks)"))
    return {"command": command, "server": info, "wall_s": wall, "load_1min": load, "replica_load": replicas,
            "kv_peak_mib": kv_peak_mib, "records": [asdict(r) for r in records]}


class KVPeak:
    """The most K/V blocks a quickdraft server's rows and prefix cache held at once while the
    sessions ran: its /metrics' quickdraft_kv_blocks_used, read every `every` seconds (a block
    several sessions share counts once: what a shared system prompt saves shows here). One client
    for every scrape: `httpx.get` makes a client each call, ~23 ms of CPU (its TLS context), which at
    4 scrapes a second took ~5% of the 2 cores from the server it measures (a cold first session's
    TTFT 10% longer than without it)."""

    def __init__(self, url: str, every: float = 0.25) -> None:
        self.url, self.every = url, every
        self.blocks, self.block_bytes = 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._client = httpx.Client(timeout=30)

    def __enter__(self) -> KVPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()  # the last state too
        self._client.close()

    def _poll(self) -> None:
        while not self._stop.wait(self.every):
            self._read()

    def _read(self) -> None:
        try:
            text = self._client.get(f"{self.url}/metrics").text
        except httpx.HTTPError:
            return  # a scrape missed: the next one counts
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "quickdraft_kv_blocks_used" and not sample.labels:
                    self.blocks = max(self.blocks, round(sample.value))
                elif sample.name == "quickdraft_kv_block_bytes" and not sample.labels:
                    self.block_bytes = round(sample.value)


def replica_load(target: Target, server: ServerProcess) -> dict[str, ReplicaLoad]:
    """quickdraft's per-replica counters now (its /metrics); none for llama-server."""
    if target.engine != "quickdraft":
        return {}
    r = httpx.get(f"{server.url}/metrics", timeout=60)
    r.raise_for_status()
    return replica_loads(r.text)


def measure_rounds(targets: Sequence[Target], rounds: int, one: Callable[[Target], dict]) -> dict[str, dict]:
    """Every target `rounds` times (`one` measures it once, on a fresh server), the order reversed
    every other round so that a drift of the machine falls on all alike. Target name -> its
    description, the last command and server info, and {"wall_s", "records"} per round."""
    runs = {t.name: {"target": asdict(t), "rounds": []} for t in targets}
    for r in range(rounds):
        for t in (targets if r % 2 == 0 else targets[::-1]):
            run = one(t)
            records = [{**rec, "round": r + 1} for rec in run["records"]]
            runs[t.name].update(command=run["command"], server=run["server"])
            runs[t.name]["rounds"].append({"wall_s": run["wall_s"], "load_1min": run.get("load_1min"),
                                           "kv_peak_mib": run.get("kv_peak_mib"),
                                           "replica_load": run.get("replica_load", {}), "records": records})
    return runs
