"""Run fedfuse's real ServerApp body and real ClientApp in one process, without Ray or a SuperLink.

``flwr run`` on the local simulation engine spends most of a small run on transport: a SuperLink, a
ServerApp process, Ray actors, every message pushed and pulled through the Runtime/Fleet APIs (a 30-round
FedAvg run on MNIST-1D: ~58 s, of which the clients' training is a few seconds). For benchmark matrices
(strategies × seeds × partitionings) this engine runs the *same code* in-process:

- the ServerApp body ``fedfuse.flower.server_app.run_server(grid, context)`` (or any ServerApp callable),
  with a server ``Context`` whose run config is the pyproject defaults fused with the overrides exactly as
  ``flwr run --run-config`` does (the same ``run_config_arg`` text, parsed by flwr's own
  ``parse_config_args`` and fused by ``get_fused_config_from_dir``);
- ``LocalGrid``, an implementation of Flower's abstract ``flwr.serverapp.Grid``: numbered nodes, each with
  the node config the simulation engine gives (``partition-id``, ``num-partitions``) and its own persistent
  ``Context``; every message goes through Flower's wire format (deflated and inflated as inflatable
  objects, so server and client never share objects), is handed to the real ``ClientApp.__call__``
  (mods, lifespan, message-type routing), and the reply comes back with the metadata a SuperLink gives it
  (``reply_to_message_id``, swapped source/destination node ids, a fresh message id). A ClientApp that
  raises becomes an error reply (``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``, reason
  ``"<class 'flwr.clientapp.client_app.ClientAppException'>:<'...'>"``) as in Flower's simulation worker,
  never a server crash.

What differs from ``flwr run``: clients run one after another in the caller's process (one torch thread,
``OMP_WAIT_POLICY=PASSIVE``, like every fedfuse process); a reply whose ClientApp call took longer than
the round's ``timeout`` is dropped (the server sees no reply, as with a late node; the clients would have
run in parallel, so each is held to the timeout alone); node ids are fixed pseudo-random 63-bit numbers
listed in partition order (``flwr run`` draws new random ids every run, so with ``fraction-train < 1`` the
partitions it samples change from run to run; here they are reproducible). With ``fraction-train = 1``
the strategy sorts replies by partition id, so both engines give the same numbers (checked by
``tests/test_inprocess_engine.py``).

    from fedfuse.flower.runner.inprocess import run_inprocess
    out = run_inprocess({"strategy": "fedavg", "num-server-rounds": 5}, num_supernodes=4)   # results folder
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: no OpenMP spin-waits on shared cores
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FEDFUSE_TORCH_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import io  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402
from collections.abc import Callable, Iterable  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from logging import ERROR, WARNING  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402
from uuid import uuid4  # noqa: E402

import torch  # noqa: E402
from flwr.app import Context, Message, RecordDict  # noqa: E402
from flwr.app.error import Error  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.clientapp.client_app import ClientAppException  # noqa: E402
from flwr.common.config import get_fused_config_from_dir, parse_config_args  # noqa: E402
from flwr.common.constant import NUM_PARTITIONS_KEY, PARTITION_ID_KEY, SUPERLINK_NODE_ID, ErrorCode  # noqa: E402
from flwr.common.logger import log  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.date import now  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute  # noqa: E402
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents  # noqa: E402
from flwr.supercore.run import Run  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedfuse.flower.client_app import app as fedfuse_client_app  # noqa: E402
from fedfuse.config import canonical  # noqa: E402
from fedfuse.flower.runner.flwr_runner import (ROOT, RunOutcome, check_app_config, federation_size,  # noqa: E402
                                              interrupted_run, run_config_arg)
from fedfuse.flower.runner.flwr_runner import results_dir_for, takes_fedfuse_config  # noqa: E402
from fedfuse.flower.server_app import run_server  # noqa: E402
from fedfuse.results import clear_run_results  # noqa: E402
from fedfuse.run_control import run_folder, signals_deferred  # noqa: E402

ServerMain = Callable[[Grid, Context], None]
SERVER_TASK_ID = 1  # the ServerApp's task id (what ``flwr.server.compat`` uses in-process too)


def over_the_wire(msg: Message) -> Message:
    """A copy of ``msg`` as the receiving side gets it: deflated to Flower's object wire format and inflated
    again (nothing shared with the sender; content that cannot be serialised fails here, as on a real grid).
    The message id, which ``Message.deflate`` leaves out, is carried over as the SuperLink does.
    Call it inside ``no_object_id_recompute()`` (each object is hashed once; a batch of messages sharing
    a record, the global model, hashes it once, as Flower's grid does when it pushes a batch); a nested
    ``no_object_id_recompute`` would start an empty cache."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    copy = inflate_object_from_contents(msg.object_id, contents)
    assert isinstance(copy, Message)
    copy.metadata.__dict__["_message_id"] = msg.metadata.message_id
    return copy


def node_ids(num_nodes: int, run_id: int) -> list[int]:
    """``num_nodes`` distinct pseudo-random 63-bit node ids (never the SuperLink's id), fixed per run id:
    random like a SuperLink's, so nothing can silently mistake a node id for a partition id."""
    rng = random.Random(run_id)
    ids: list[int] = []
    while len(ids) < num_nodes:
        nid = rng.getrandbits(63)
        if nid > SUPERLINK_NODE_ID and nid not in ids:
            ids.append(nid)
    return ids


@contextmanager
def task_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
    """Set Flower's process-wide ``TaskIdentity`` (which ``Message(...)`` reads for ``run_id`` and
    ``src_node_id``) for the duration, restoring what was there before."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class LocalGrid(Grid):
    """Flower's ``Grid`` over ``num_nodes`` in-process nodes running ``client_app``.

    Node ``i`` (``get_node_ids()[i]``) has node config ``{"partition-id": i, "num-partitions": num_nodes}``
    and one ``Context`` kept for the whole run (its ``state`` persists between messages, as on a SuperNode).
    ``push_messages`` delivers each message at once (in order) and keeps the reply until
    ``pull_messages`` collects it; ``send_and_receive`` is the two in a row.

    Args:
        client_app: the ClientApp (``ClientApp`` object or any ``(message, context) -> Message`` callable).
        run_config: the fused run config every node's ``Context`` carries.
        num_nodes: number of nodes (= partitions).
        run_id: the run id messages and contexts carry.
        partitions: host only these partition ids of ``num_nodes`` partitions (one node each, node config
            ``num-partitions`` stays ``num_nodes``): a federation of a subset of the clients on the same
            splits (e.g. "only the full-width clients" of a capacity-tier run). ``None`` = all.
    """

    def __init__(self, client_app: Callable[[Message, Context], Message], run_config: dict[str, Any],
                 num_nodes: int, run_id: int = 1, partitions: list[int] | None = None) -> None:
        if num_nodes < 1:
            raise ValueError(f"LocalGrid: num_nodes must be >= 1, got {num_nodes}")
        hosted = list(range(num_nodes)) if partitions is None else [int(p) for p in partitions]
        if not hosted or len(set(hosted)) != len(hosted) or not all(0 <= p < num_nodes for p in hosted):
            raise ValueError(f"LocalGrid: partitions must be distinct ids in [0, {num_nodes}), got {partitions!r}")
        self.client_app = client_app
        self._run = Run.create_empty(run_id)
        self._node_ids = node_ids(len(hosted), run_id)
        self.contexts: dict[int, Context] = {
            nid: Context(run_id=run_id, node_id=nid,
                         node_config={PARTITION_ID_KEY: p, NUM_PARTITIONS_KEY: num_nodes},
                         state=RecordDict(), run_config=dict(run_config))
            for p, nid in zip(hosted, self._node_ids)}
        self._replies: dict[str, Message] = {}     # instruction message id -> reply, until pulled
        self._seconds: dict[str, float] = {}       # instruction message id -> ClientApp seconds
        self.client_seconds: list[float] = []     # every ClientApp call's seconds, in order

    # ------------------------------------------------------------------ run
    def set_run(self, run: Run) -> None:
        if not isinstance(run, Run):
            raise TypeError(f"`run` must be an instance of Run, got {type(run).__name__}")
        self._run = run
        for ctx in self.contexts.values():
            ctx.run_id = run.run_id

    @property
    def run(self) -> Run:
        return Run(**vars(self._run))

    # ------------------------------------------------------------------ nodes and messages
    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def partition_of(self, node_id: int) -> int:
        return int(self.contexts[node_id].node_config[PARTITION_ID_KEY])

    def _check_message(self, msg: Message) -> None:
        """What the SuperLink accepts from a ServerApp: an instruction (not a reply) to a known node, alive."""
        md = msg.metadata
        if md.reply_to_message_id != "" or md.ttl <= 0 or md.delivered_at != "":
            raise ValueError(f"LocalGrid: invalid message (reply_to={md.reply_to_message_id!r}, ttl={md.ttl}, "
                             f"delivered_at={md.delivered_at!r}): {msg}")
        if md.dst_node_id not in self.contexts:
            raise ValueError(f"LocalGrid: message to unknown node {md.dst_node_id}; nodes are {self._node_ids}")
        if md.run_id != self._run.run_id:
            raise ValueError(f"LocalGrid: message of run {md.run_id}, this grid runs {self._run.run_id}")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            self._check_message(msg)
        with no_object_id_recompute():  # the batch's shared records (the global model) are serialised once
            received = [over_the_wire(msg) for msg in messages]
        for copy in received:
            mid = copy.metadata.message_id
            self._replies[mid], self._seconds[mid] = self._deliver(copy)
        return [msg.metadata.message_id for msg in messages]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in message_ids if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        replies = []
        for mid, reply in zip(ids, self.pull_messages(ids)):
            seconds = self._seconds.pop(mid, 0.0)
            if timeout is not None and seconds > timeout:
                # the node would have answered after the round's deadline: the server sees no reply
                log(WARNING, "LocalGrid: node %d (partition %d) took %.1fs, more than the round timeout %.1fs; "
                    "its reply is dropped", reply.metadata.src_node_id, self.partition_of(reply.metadata.src_node_id),
                    seconds, timeout)
                continue
            replies.append(reply)
        return replies

    # ------------------------------------------------------------------ one node
    def _deliver(self, received: Message) -> tuple[Message, float]:
        """Run the ClientApp of the node ``received`` (a wire copy) is for; its reply (or an error reply) as
        the server receives it, and the seconds the ClientApp took."""
        node_id = received.metadata.dst_node_id
        context = self.contexts[node_id]
        received.metadata.delivered_at = now().isoformat()
        t0 = time.perf_counter()
        try:
            with task_identity(self._run.run_id, node_id, SERVER_TASK_ID + 1 + self.partition_of(node_id)):
                try:
                    reply = self.client_app(received, context)
                except Exception as exc:  # noqa: BLE001 - what Flower's actor does: wrap, then an error reply
                    raise ClientAppException(str(exc)) from exc
            reply = self._checked_reply(reply, received)
        except Exception as ex:  # noqa: BLE001 - the simulation worker's error reply (vce_api.worker)
            log(ERROR, "LocalGrid: ClientApp of node %d (partition %d) raised: %s", node_id,
                self.partition_of(node_id), ex)
            code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION if isinstance(ex, ClientAppException) else ErrorCode.UNKNOWN
            reply = Message(Error(code=code, reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=received)
        seconds = time.perf_counter() - t0
        self.client_seconds.append(seconds)
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        with no_object_id_recompute():
            return over_the_wire(reply), seconds

    @staticmethod
    def _checked_reply(reply: Any, msg: Message) -> Message:
        """The checks the SuperLink makes before storing a reply (a reply it would drop would leave the
        server waiting for the whole round timeout; here it is an error reply naming the problem)."""
        if not isinstance(reply, Message):
            raise TypeError(f"the ClientApp returned {type(reply).__name__}, not a Message "
                            f"(reply with Message(content, reply_to=message))")
        md, ins = reply.metadata, msg.metadata
        if (md.reply_to_message_id != ins.message_id or md.src_node_id != ins.dst_node_id
                or md.dst_node_id != ins.src_node_id or md.run_id != ins.run_id):
            raise ValueError(f"the ClientApp's reply is not a reply to message {ins.message_id} "
                             f"(reply_to={md.reply_to_message_id!r}, src={md.src_node_id}, dst={md.dst_node_id}); "
                             "build it with Message(content, reply_to=message)")
        return reply


def fused_run_config(run_config: dict[str, Any], app_dir: Path = ROOT) -> dict[str, Any]:
    """The run config a ``flwr run <app_dir> --run-config ...`` ServerApp/ClientApp sees: ``run_config``
    written as the runner's ``--run-config`` text, parsed back by flwr's own parser and fused with the
    app's ``[tool.flwr.app.config]`` defaults (flwr's ``get_fused_config_from_dir``; unknown keys raise)."""
    if run_config and takes_fedfuse_config(app_dir):
        run_config = canonical(run_config)
    overrides = parse_config_args([run_config_arg(run_config)]) if run_config else {}
    return dict(get_fused_config_from_dir(Path(app_dir), overrides))


def _default_client_app() -> ClientApp:
    return fedfuse_client_app


def _default_server() -> ServerMain:
    return run_server


def run_id_for(run_name: str) -> int:
    """A fixed run id per run name (a real SuperLink draws one at random; nothing in fedfuse depends on it)."""
    return zlib.crc32(run_name.encode()) + 1


class _Capture(logging.Handler):
    """Keeps the formatted ``flwr`` log lines of one run (``RunOutcome.log``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.buffer = io.StringIO()
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.buffer.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


class _LineHandler(logging.Handler):
    """Hands each ``flwr`` log record to ``on_line`` as ``"LEVEL : message"`` (the form Flower's console
    prints, which ``fedfuse.flower.runner.console`` reads)."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        super().__init__(logging.DEBUG)
        self.on_line = on_line
        self.setFormatter(logging.Formatter("%(levelname)-8s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.on_line(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - logging must never break the run
            self.handleError(record)


@contextmanager
def _logging(echo: bool, on_line: Callable[[str], None] | None = None) -> Iterator[_Capture]:
    """Capture the ``flwr`` logger's lines; without ``echo`` its console handlers show warnings only, or
    nothing when ``on_line`` receives every line (the caller decides what the console shows)."""
    logger = logging.getLogger("flwr")
    capture = _Capture()
    logger.addHandler(capture)
    saved = [(h, h.level) for h in logger.handlers if h is not capture]
    line_handler = _LineHandler(on_line) if on_line is not None else None
    if line_handler is not None:
        logger.addHandler(line_handler)
    if not echo:
        for h, level in saved:
            h.setLevel(logging.CRITICAL + 1 if line_handler is not None else max(level, WARNING))
    try:
        yield capture
    finally:
        logger.removeHandler(capture)
        if line_handler is not None:
            logger.removeHandler(line_handler)
        for h, level in saved:
            h.setLevel(level)


def prepare(run_config: dict[str, Any], num_supernodes: int | None, app_dir: Path,
            check_config: bool | None) -> tuple[dict[str, Any], int, Path]:
    """The run config with the runner defaults ``run_app`` fills in (absolute ``output-dir``, a
    ``run-name``, ``num-clients`` = the node count: ``flwr_runner.federation_size``), checked like ``run_app`` checks
    it; also the node count and results dir."""
    cfg = canonical(run_config) if takes_fedfuse_config(app_dir) else dict(run_config)
    cfg.setdefault("output-dir", str(results_dir_for(app_dir)))
    cfg.setdefault("run-name", f"run-{time.strftime('%Y%m%d-%H%M%S')}")
    n = federation_size(cfg, num_supernodes)
    check_app_config(cfg, Path(app_dir), check_config)
    return cfg, n, Path(cfg["output-dir"]) / cfg["run-name"]


def run_app_inprocess(run_config: dict[str, Any], *, num_supernodes: int | None = None, echo: bool = True,
                      app_dir: Path = ROOT, check_config: bool | None = None,
                      client_app: Callable[[Message, Context], Message] | None = None,
                      server: ServerMain | None = None,
                      on_line: Callable[[str], None] | None = None,
                      partitions: list[int] | None = None) -> RunOutcome:
    """``run_app``'s in-process twin: the same run (config defaults, check, results folder) on a
    ``LocalGrid``; returns a ``RunOutcome`` whose status is ``finished:completed`` or ``finished:failed``
    (the ServerApp raised; its exception in ``details``, results still written by the ServerApp).
    ``on_line`` receives every ``flwr`` log line (``"LEVEL : message"``), as ``run_app``'s does.

    ``client_app`` / ``server`` default to fedfuse's ClientApp and ``run_server``; pass e.g. a test app's
    (with its ``app_dir``, whose pyproject declares its extra run-config keys). ``partitions``: host only these
    partition ids of the run's ``num-clients`` partitions (``LocalGrid``).

    As ``run_app``: the run holds its folder (``RunFolderBusy`` when another run does), starts it afresh unless
    ``resume``, and interrupted (Ctrl-C; SIGTERM under ``interrupt_signals``) marks ``results.json`` ``interrupted``
    at its last completed round and raises ``RunInterrupted``.
    """
    chosen = "run-name" in run_config
    cfg, n, out_dir = prepare(run_config, num_supernodes, app_dir, check_config)
    with run_folder(cfg["output-dir"], str(cfg["run-name"]), chosen_by_user=chosen) as name:
        cfg["run-name"] = name
        out_dir = Path(cfg["output-dir"]) / name
        if not cfg.get("resume"):
            clear_run_results(out_dir)
        try:
            return _run_inprocess(cfg, n, out_dir, echo=echo, app_dir=app_dir, client_app=client_app,
                                  server=server, on_line=on_line, partitions=partitions)
        except KeyboardInterrupt as exc:   # Ctrl-C, or SIGTERM/SIGHUP under run_control.interrupt_signals
            with signals_deferred():
                interrupted = interrupted_run(exc, out_dir)
            raise interrupted from None


def _run_inprocess(cfg: dict[str, Any], n: int, out_dir: Path, *, echo: bool, app_dir: Path,
                   client_app: Callable[[Message, Context], Message] | None, server: ServerMain | None,
                   on_line: Callable[[str], None] | None, partitions: list[int] | None) -> RunOutcome:
    """``run_app_inprocess``'s body, in its held folder."""
    fused = fused_run_config(cfg, app_dir)
    run_id = run_id_for(str(cfg["run-name"]))
    server_fn = server or _default_server()
    grid = LocalGrid(client_app or _default_client_app(), fused, n, run_id=run_id, partitions=partitions)
    context = Context(run_id=run_id, node_id=SUPERLINK_NODE_ID, node_config={}, state=RecordDict(),
                      run_config=dict(fused))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    status, details = "finished:completed", ""
    try:
        with _logging(echo, on_line) as capture, task_identity(run_id, SUPERLINK_NODE_ID, SERVER_TASK_ID):
            try:
                server_fn(grid, context)
            except Exception as exc:  # noqa: BLE001 - the run's outcome, as flwr reports a failed ServerApp
                status, details = "finished:failed", f"ServerApp failed with exception: {type(exc).__name__}: {exc}"
                log(ERROR, "%s", details)
    finally:
        torch.set_num_threads(threads)
    return RunOutcome(run_id=run_id, status=status, details=details, out_dir=out_dir, log=capture.buffer.getvalue(),
                      seconds=time.perf_counter() - t0)


def run_inprocess(run_config: dict[str, Any], num_supernodes: int | None = None, *, echo: bool = True,
                  app_dir: Path = ROOT, check_config: bool | None = None,
                  client_app: Callable[[Message, Context], Message] | None = None,
                  server: ServerMain | None = None) -> Path:
    """Run fedfuse's ServerApp and ClientApps in this process; the results folder
    (``<output-dir>/<run-name>``). A failed run raises ``RuntimeError`` with the ServerApp's error (the
    ServerApp has written ``results.json`` with ``"status": "failed"`` first); a bad config raises
    ``fedfuse.config.ConfigError`` before anything runs."""
    outcome = run_app_inprocess(run_config, num_supernodes=num_supernodes, echo=echo, app_dir=app_dir,
                                check_config=check_config, client_app=client_app, server=server)
    if not outcome.ok:
        raise RuntimeError(f"fedfuse in-process run {outcome.out_dir.name}: {outcome.details}")
    return outcome.out_dir
