"""Weights in memory to a vLLM server, through vLLM's own weight-transfer engines
(`vllm.distributed.weight_transfer`): `nccl` on GPUs, and on CPU a `gloo` engine registered here
through the same registry, so a CPU machine runs the code path GPUs take with only the transport
swapped.

The round trip is vLLM's: the trainer's sender (rank 0) asks the server over HTTP to
`/init_weight_transfer_engine` once (every server worker joins a process group with it), and per
update to `/start_weight_update`, `/update_weights` (the workers receive while the trainer sends:
the HTTP call runs on a side thread) and `/finish_weight_update`. The trainer's tensors travel in
buckets of about `bucket_bytes`, cut alike on both sides from the metadata the trainer sends first;
every worker (each tensor-parallel shard and data-parallel replica) receives every bucket and
vLLM's `load_weights` keeps its own shard. Loading runs inside vLLM's layerwise reload
(`initialize_layerwise_reload` / `finalize_layerwise_reload`), as the NCCL engine does.

Every gloo and HTTP wait has a timeout: the gloo process group's (`timeout_s`: a peer that dies or
stalls mid-transfer fails the collective on the other side instead of hanging it), and the HTTP
calls'. vLLM's NCCL engine takes no timeout for its broadcasts: a server that dies mid-transfer
there can leave the trainer waiting inside NCCL (not yet seen on a GPU; the HTTP call beside it
still fails at its timeout, but the broadcast is not interrupted). A failed
transfer leaves the server serving (with partly updated weights until the next update) and its
transfer group torn down; the trainer's next update re-initialises it.

Registration: `register()` adds `gloo` to vLLM's worker and trainer registries. The server's
workers import this module through grouprl's worker extension (`grouprl vllm-serve` names it),
which registers the engine before vLLM builds it.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, ClassVar, Iterator

import torch

from grouprl.lora import merged_weight_meta
from grouprl.rollout.vllm import repack_tied_head

BACKEND = "gloo"
DEFAULT_BUCKET_BYTES = 256 << 20


def bucket_plan(names: list[str], sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges over tensors named `names` of `sizes` bytes, in order: a bucket
    closes once it holds at least `bucket_bytes`, and only between layers (tensors whose names
    share the prefix up to the first number, `model.layers.3.`, stay in one bucket). So a transfer
    that fails leaves every layer wholly new or wholly old. Both sides cut from the same metadata,
    so they agree without sending the cuts; a layer larger than `bucket_bytes` travels alone."""
    plan, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        last = i + 1 == len(sizes)
        if last or (total >= bucket_bytes and _layer_key(names[i]) != _layer_key(names[i + 1])):
            plan.append((start, i + 1))
            start, total = i + 1, 0
    return plan


def _layer_key(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `model.layers.3`; a name without a number is its own."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return name


def _nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _open_group(host: str, port: int, rank: int, world_size: int, timeout_s: float,
                listen_socket: socket.socket | None = None):
    """A gloo process group outside torch.distributed's global state (vLLM's stateless helper):
    the trainer's own process group and vLLM's are untouched."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(host, port, rank, world_size, "gloo",
                                                          listen_socket=listen_socket,
                                                          timeout=timedelta(seconds=timeout_s))


def _close_group(pg) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    try:
        stateless_destroy_torch_distributed_process_group(pg)
    except Exception:  # already broken by a dead peer: nothing left to release
        pass


# ----------------------------------------------------------------------------- the worker side
def _engine_classes():
    """The engine classes, defined on first use: they subclass vLLM's, and vLLM is optional."""
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """What a server worker needs to join the trainer's group (sent by the trainer)."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 240.0
        bucket_bytes: int = DEFAULT_BUCKET_BYTES

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        """One update's tensors, in the order they are sent."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(f"gloo weight update: {len(self.names)} names, {len(self.dtype_names)} dtypes "
                                 f"and {len(self.shapes)} shapes: the lists must be alike")

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """Server worker side: receives each bucket by broadcast from the trainer (rank 0) into
        host memory and loads it with the model's own `load_weights`."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group, self.bucket_bytes = None, DEFAULT_BUCKET_BYTES

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            self.shutdown()  # a new trainer (a resumed run) replaces the previous one's group
            p = self.parallel_config
            rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
            self.bucket_bytes = init_info.bucket_bytes
            self.group = _open_group(init_info.master_address, init_info.master_port, rank,
                                     init_info.world_size, init_info.timeout_s)

        # vLLM's layerwise reload puts the layers on the meta device until their weights arrive:
        # started in start_weight_update, a trainer that died before its update_weights would leave
        # the server generating from meta tensors (measured: the engine dies). Here it runs inside
        # update_weights, one call, and a failure mid-transfer still finalizes, which puts the old
        # weights back in every layer that received nothing (buckets never split a layer).
        def start_weight_update(self) -> None:
            pass

        def finish_weight_update(self) -> None:
            pass

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # host memory: no device sync

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            if self.group is None:
                raise RuntimeError("gloo weight transfer: update before init_weight_transfer_engine (or after a "
                                   "failed one): the trainer re-initialises it")
            names, shapes = update_info.names, update_info.shapes
            dtypes = [getattr(torch, d) for d in update_info.dtype_names]
            sizes = [_nbytes(d, s) for d, s in zip(dtypes, shapes)]
            plan = bucket_plan(names, sizes, self.bucket_bytes)

            def receive(k: int):  # posted before bucket k-1 loads: gloo receives on its own thread
                flat = torch.empty(sum(sizes[plan[k][0]:plan[k][1]]), dtype=torch.uint8)
                return flat, self.group.broadcast(flat, 0)

            initialize_layerwise_reload(self.model)
            try:
                pending = receive(0) if plan else None
                for k, (start, stop) in enumerate(plan):
                    flat, work = pending
                    work.wait()
                    pending = receive(k + 1) if k + 1 < len(plan) else None
                    parts = flat.split(sizes[start:stop])
                    self.model.load_weights([(n, t.view(d).view(s)) for n, t, d, s in zip(
                        names[start:stop], parts, dtypes[start:stop], shapes[start:stop])])
            except Exception:
                self.shutdown()  # the group is unusable after a failed collective; the trainer re-inits
                raise
            finally:
                finalize_layerwise_reload(self.model, self.model_config)
                _repack_tied_head(self.model)

        def shutdown(self) -> None:
            if self.group is not None:
                group, self.group = self.group, None
                _close_group(group)

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """Trainer side: where the group meets (the trainer listens), how many take part (1 +
        the server's workers), the per-collective timeout and the bucket size."""

        backend: ClassVar[str] = BACKEND

        master_address: str
        world_size: int
        master_port: int = 0  # 0: any free port
        timeout_s: float = 240.0
        bucket_bytes: int = DEFAULT_BUCKET_BYTES

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Trainer side: rank 0 packs each bucket into one flat byte tensor and broadcasts it while
        the server's workers receive; the other ranks only iterate the source (FSDP2's gathers are
        collectives every rank joins)."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True, timeout_s: float = 240.0,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES):
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.timeout_s, self.bucket_bytes, self.group = timeout_s, bucket_bytes, None

        @classmethod
        def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
            if source is None:
                raise ValueError("gloo weight transfer needs a WeightSource")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                         timeout_s=init_info.timeout_s, bucket_bytes=init_info.bucket_bytes)
            if not engine.is_sender:
                return engine
            listen = socket.create_server(("", init_info.master_port))  # bound now: no port race
            port = listen.getsockname()[1]
            worker_info = GlooInitInfo(master_address=init_info.master_address, master_port=port, rank_offset=1,
                                       world_size=init_info.world_size, timeout_s=init_info.timeout_s,
                                       bucket_bytes=init_info.bucket_bytes)
            with ThreadPoolExecutor(max_workers=1) as pool:  # the workers block in init until we join
                answer = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
                try:
                    engine.group = _open_group(init_info.master_address, port, 0, init_info.world_size,
                                               init_info.timeout_s, listen_socket=listen)
                except Exception:
                    if answer.done():
                        answer.result()  # the server's refusal says more than our timeout
                    raise
                answer.result(timeout=init_info.timeout_s)
            return engine

        def send_weights(self) -> None:
            meta = self.source.metadata()
            if not self.is_sender:
                for _ in self.source:
                    pass
                return
            info = GlooUpdateInfo(names=[m.name for m in meta], dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
                                  shapes=[list(m.shape) for m in meta])
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                answer = pool.submit(self.client.update_weights, asdict(info))
                self._broadcast(meta, answer)
                answer.result(timeout=self.timeout_s)
            except FutureTimeout as e:
                raise TimeoutError(f"the server did not confirm the weights within {self.timeout_s:g} s") from e
            finally:
                pool.shutdown(wait=False)  # a failed collective may leave the HTTP call waiting: never join it
            self.client.finish_weight_update()

        def _broadcast(self, meta, answer) -> None:
            sizes = [_nbytes(m.dtype, m.shape) for m in meta]
            pairs, sending = iter(self.source), None
            for start, stop in bucket_plan([m.name for m in meta], sizes, self.bucket_bytes):
                parts = []
                for m in meta[start:stop]:  # packed while the previous bucket is on the wire
                    name, tensor = next(pairs)
                    if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
                        raise ValueError(f"weight source: {name} {tensor.dtype} {tuple(tensor.shape)} where its "
                                         f"metadata said {m.name} {m.dtype} {tuple(m.shape)}")
                    parts.append(tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
                flat = torch.cat(parts) if len(parts) > 1 else parts[0]
                if sending is not None:
                    sending.wait()
                if answer.done():
                    answer.result()  # the server refused: say so instead of waiting for its receive
                sending = self.group.broadcast(flat, 0)
            if sending is not None:
                sending.wait()

        def shutdown(self) -> None:
            if self.group is not None:
                group, self.group = self.group, None
                _close_group(group)

    return GlooWeightTransferEngine, GlooTrainerWeightTransferEngine, GlooTrainerInitInfo


def register() -> None:
    """Add the gloo engine to vLLM's worker and trainer registries (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if _registered(WeightTransferEngineFactory, BACKEND):
        return
    worker, trainer, _ = _classes()
    WeightTransferEngineFactory.register_engine(BACKEND, worker)
    WeightTransferTrainerFactory.register_engine(BACKEND, trainer)


def _registered(factory: type, name: str) -> bool:
    """Whether vLLM's weight-transfer `factory` holds an engine called `name`. vLLM offers no public
    query (`register_engine` raises on a second registration; `create_engine` needs a whole
    config), so this reads the factory's private `_registry` dict (checked on vLLM 0.32.0,
    `vllm/distributed/weight_transfer/factory.py`): the one place grouprl does."""
    return name in factory._registry


_CLASSES = None


def _classes():
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _engine_classes()
    return _CLASSES


def _repack_tied_head(model: torch.nn.Module) -> None:
    """vLLM's CPU build packs a copy of a tied LM head when the model loads, and a reload refreshes
    only the embedding (rollout/vllm.py, `_repack_tied_lm_head`): pack it again."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        repack_tied_head(model)


# ----------------------------------------------------------------------------- the trainer side
class PolicySource:
    """The policy's weights as vLLM's `WeightSource` wants them: checkpoint names, LoRA merged
    (W + BA), an FSDP2 shard gathered. `metadata()` reads names, dtypes and shapes without
    computing a merge or gathering; iterating yields one tensor at a time."""

    def __init__(self, model: torch.nn.Module, weights: Callable[[torch.nn.Module], Iterator]):
        from vllm.distributed.weight_transfer.base import ParamMeta

        self.model, self.weights, self._meta_cls = model, weights, ParamMeta

    def metadata(self):
        return [self._meta_cls(name, dtype, tuple(shape)) for name, dtype, shape in merged_weight_meta(self.model)]

    def __iter__(self):
        for (name, tensor), (_, dtype, _) in zip(self.weights(self.model), merged_weight_meta(self.model)):
            yield name, tensor.to(dtype)  # W + BA in the base weight's dtype, as the metadata says


class HTTPSyncClient:
    """vLLM's four-call weight-sync protocol (`VLLMWeightSyncClient`) over the server's RL routes,
    through the engine's own POST (its timeouts and its errors naming host:port)."""

    def __init__(self, post: Callable[[str, dict, str], Any], weight_version: Callable[[], str]):
        self.post, self.weight_version = post, weight_version

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info}, "join the weight-transfer group")

    def start_weight_update(self) -> None:
        self.post("/start_weight_update", {}, "start a weight update")

    def update_weights(self, update_info) -> None:
        self.post("/update_weights", {"update_info": update_info}, "receive the new weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.post("/finish_weight_update", {"weight_version": weight_version or self.weight_version()},
                  "finish the weight update")

    def shutdown_weight_transfer_engine(self) -> None:
        self.post("/shutdown_weight_transfer_engine", {}, "leave the weight-transfer group")


def trainer_engine(backend: str, *, client: HTTPSyncClient, source: PolicySource, rank: int, address: str,
                   server_workers: int, timeout_s: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """vLLM's trainer-side engine for `backend` (`gloo` or `nccl`), joined with the server's
    workers. Every trainer rank calls it; rank 0 is the sender."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    if backend == BACKEND:
        register()
        info = _classes()[2](rank=rank, master_address=address, world_size=1 + server_workers,
                             timeout_s=timeout_s, bucket_bytes=bucket_bytes)
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(rank=rank, master_address=address, master_port=_free_port(),
                                   world_size=1 + server_workers, packed_buffer_size_bytes=bucket_bytes)
    else:
        raise ValueError(f"weight transfer backend {backend!r}: grouprl drives gloo and nccl")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def address_seen_from(host: str, port: int) -> str:
    """This machine's address on the route to host:port: where the server's workers reach the
    trainer (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
