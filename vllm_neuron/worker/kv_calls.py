"""The runner's calls for the KV that leaves its pool: disaggregated prefill/decode (worker/kv_connector.py,
called by engine/kv_transfer.py) and the second tier (worker/kv_tier_store.py, called by engine/kv_tier.py). A
tensor-parallel executor replays each on every rank, so each rank moves its own heads."""
from __future__ import annotations

from vllm_neuron.config.kv_offload import KVOffloadConfig
from vllm_neuron.config.kv_transfer import KVTransferConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.step import KVLoadJob, TierLoadJob
from vllm_neuron.worker.kv_connector import KVConnectorWorker
from vllm_neuron.worker.kv_tier_store import KVTierStore


class KVConnectorCalls:
    kv_caches: list
    block_size: int
    kv_connector: KVConnectorWorker | None
    kv_tier: KVTierStore | None

    def open_kv_connector(self, cfg: KVTransferConfig, num_kv_heads: int) -> None:
        info = ps.info()
        self.kv_connector = KVConnectorWorker(cfg, self.kv_caches, self.block_size, num_kv_heads, info.rank,
                                              info.world)

    def close(self) -> None:
        """Ends what the runner started beside its graphs (the KV connector's threads, sockets, NIXL agent)."""
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self.kv_tier is not None:
            self.kv_tier.close()  # after the writes queued so far
            self.kv_tier = None

    # -- disaggregated prefill/decode (worker/kv_connector.py; engine/kv_transfer.py calls these) ---------
    def kv_hold(self, holds: list[tuple[str, str, list[list[int]]]]) -> None:
        """Serve these requests' blocks to their readers (a prefill instance): (key, secret, per-group ids)."""
        self.kv_connector.hold(holds)

    def kv_forget(self, keys: list[str]) -> None:
        self.kv_connector.forget(keys)

    def kv_drain_released(self) -> list[str]:
        return self.kv_connector.drain_released()

    def kv_start_loads(self, jobs: list[KVLoadJob]) -> None:
        """Start reading remote requests' blocks (a decode instance); poll with kv_poll_loads."""
        self.kv_connector.start_loads(jobs)

    def kv_poll_loads(self, req_ids: list[str]) -> list[int]:
        return self.kv_connector.poll_loads(req_ids)

    def kv_loads_done(self, jobs: list[KVLoadJob]) -> None:
        self.kv_connector.loads_done(jobs)

    def kv_take_results(self) -> list[tuple[bool, int, float]]:
        """(read, bytes, seconds) of this rank's loads since the last call."""
        return [(r.ok, r.nbytes, r.seconds) for r in self.kv_connector.take_results()]

    # -- KV offloading (worker/kv_tier_store.py; engine/kv_tier.py calls these) ----------------------------
    def kv_tier_open(self, cfg: KVOffloadConfig, model_key: str) -> str:
        """Opens this rank's share of the second tier; the model's folder (the same on every rank)."""
        info = ps.info()
        self.kv_tier = KVTierStore(cfg, model_key, self.kv_caches, self.block_size, info.rank, info.world)
        return self.kv_tier.folder

    def kv_tier_store(self, blocks: list[tuple[int, bytes]]) -> None:
        self.kv_tier.store(blocks)

    def kv_tier_load(self, jobs: list[TierLoadJob]) -> None:
        self.kv_tier.load(jobs)

    def kv_tier_poll(self, req_ids: list[str]) -> list[int]:
        return self.kv_tier.poll(req_ids)

    def kv_tier_finish(self, req_ids: list[str]) -> list[tuple[int, int, float]]:
        return self.kv_tier.finish(req_ids)

