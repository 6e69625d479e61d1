"""Continuous-batching scheduler: each step is a prefill batch or a decode batch, never both.

Policy:
* Prefill batches take partially prefilled requests first, then waiting ones in arrival order, up to
  `max_num_batched_tokens` tokens; a longer prompt is split over steps (segmented prefill). Cached
  prefix blocks are skipped.
* TTFT first, decodes bounded: prefill work runs as soon as it can, and between two decode steps the
  prefill steps together process at most `max_num_batched_tokens` tokens (the work of one full prefill
  step). While requests are ready to decode, a first prefill step may take the whole budget (splitting
  a long prompt); further prefill steps before the next decode step only take requests whose remaining
  prompt fits whole in what is left. So a waiting prefill waits for at most one decode step, a decode
  waits for at most one budget of prefill tokens however many prompts arrive (small prompts arriving
  one by one, e.g. short suffixes after a cached prefix, run back to back), and each kind is served
  first come, first served: prefills in admission then arrival order, never overtaking; every decodable
  request in every decode step.
* Where prefill is compute-bound (CPU), a waiting prompt joins the step being formed only where that lowers
  the mean time to first token (core/prefill_batching.py): a few prompts that fill buckets of their own go
  one step each, small ones fill a bucket's padding, a long queue goes in full steps. The step's last
  prompt, when nothing behind it could join (none waits, or no seat is free), is split at a bucket's size
  where the padding saved outweighs a step's overhead (160 tokens: steps of 128 and 32, not one of 256).
* A request that asks for prompt logprobs is prefilled in steps with only such requests, and neither
  reads nor fills the prefix cache (see `_wants_prompt_logprobs`).
* Speculative decoding: a decode chunk carries the request's draft tokens after its last token (capped
  so that no output can pass max_tokens or max_model_len); their slots are allocated with it, or the
  drafts are dropped when blocks are short. After the step, the rejected drafts' positions are rolled
  back: num_computed_tokens counts only verified tokens, blocks past them go back to the pool, and only
  blocks full of verified tokens are ever hashed into the prefix cache. Drafts are left out of a step
  when they do not pay (core/spec_policy.py: a request whose drafts are mostly rejected, a batch of at
  least disable_by_batch_size requests); each decode step tells the runner which requests may use drafts
  proposed after it (`spec_req_ids`), so it proposes none for the others.
* When KV blocks run out during decode, the newest running request is preempted: its blocks are freed
  and it is recomputed later (its full blocks usually come back as prefix-cache hits). Prefill never
  preempts; it waits for blocks. Startup guarantees one request of max_model_len always fits, so this
  never deadlocks and never drops a request.
* `policy="priority"` (vLLM's --scheduling-policy priority): "arrival order" above becomes (priority,
  arrival) order, lower priority values first: the waiting queue is kept sorted by it (a preempted
  request goes back to its place in it), decode steps hand out blocks in that order, and the victim of a
  preemption is the running request last in it (the largest priority value, the latest arrival among
  equals). As in vLLM, a running request is never preempted only to admit a waiting one.
* LoRA (`max_loras` > 0): a request holds its adapter's device slot from its first step until it finishes
  (worker/lora/slots.py), so at most `max_loras` distinct adapters are ever held at once: a waiting request
  whose adapter would be one too many is passed over (later requests may start) until a holder finishes.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_neuron.core.kv_cache_manager import KVCacheManager
from vllm_neuron.core.kv_tier import KVTierScheduler
from vllm_neuron.core.kv_transfer import KVTransferScheduler
from vllm_neuron.core.request import Request, RequestStatus
from vllm_neuron.core.spec_decode_stats import SpecDecodeStats
from vllm_neuron.core.prefill_batching import first_segment, joins_step
from vllm_neuron.core.spec_policy import SpecPolicy
from vllm_neuron.core.stop_checker import check_stop
from vllm_neuron.kv_cache_groups import KVCacheLayout
from vllm_neuron.logger import init_logger
from vllm_neuron.step import (PLACEHOLDER_TOKEN_ID, KVLoadJob, ModelRunnerOutput, NewRequestData,
                              ScheduledChunk, SchedulerOutput)

logger = init_logger(__name__)


def _wants_prompt_logprobs(req: Request) -> bool:
    """Such a request neither reads nor fills the prefix cache: its logprobs need every prompt position
    computed (as vLLM does: the hit is refused, not recomputed), and its K/V come from the eagerly run graph
    function, which other requests' prefix hits should not read in place of their compiled graphs' values."""
    return req.sampling_params.prompt_logprobs is not None


def _skips_prefix_cache(req: Request) -> bool:
    """Prompt-logprobs requests (above) and pooling requests: a pooled output (a mean, a first token) needs the
    hidden states of every prompt position, which a prefix hit would skip."""
    return _wants_prompt_logprobs(req) or req.pooling_params is not None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    # Largest total of already-cached context tokens one prefill batch may attend to (the largest
    # prefill context bucket).
    max_prefill_context_tokens: int | None = None
    num_speculative_tokens: int = 0  # K: most drafts verified per request and step (0: no speculation)
    spec_disable_by_batch_size: int | None = None  # steps with at least this many running requests: no drafts
    # KV cache groups (kv_cache_groups.py): None is one group of every layer.
    kv_cache_layout: KVCacheLayout | None = None
    policy: str = "fcfs"  # or "priority" (config/engine_args.py's SCHEDULING_POLICIES, checked there)
    # A bidirectional encoder's prompts are never split over steps (they attend both ways, with no KV cache).
    whole_prompts: bool = False
    max_loras: int = 0  # LoRA: distinct adapters the runner can hold at once (0: LoRA off)
    # Prefill steps (core/prefill_batching.py): the token buckets, and a step's fixed cost in tokens where
    # prefill is compute-bound (None: every prompt that fits joins the step).
    prefill_buckets: tuple[int, ...] = ()
    prefill_step_overhead_tokens: int | None = None
    # Split a prompt at bucket sizes where that costs less (prefill_batching.first_segment): only where a later
    # segment reads the earlier ones through block tables (the attention kernel), not through context buckets.
    split_prompts_at_buckets: bool = False


def _lora_id(req: Request | None) -> int | None:
    lr = req.lora_request if req is not None else None
    return lr.lora_int_id if lr is not None else None


def _priority_key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


@dataclass
class FinishedRequest:
    request: Request
    finish_reason: str
    # Of the step's sampled tokens, how many are the request's (a verification can emit tokens past a stop).
    num_new_tokens: int | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_transfer: KVTransferScheduler | None = None,
                 kv_tier: KVTierScheduler | None = None) -> None:
        """kv_transfer: a disaggregated instance's side of its transfers (core/kv_transfer.py); kv_tier: the
        second KV tier's (core/kv_tier.py)."""
        self.config = config
        self._by_priority = config.policy == "priority"
        self.kv_transfer = kv_transfer
        self.kv_tier = kv_tier
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.kv_cache_layout)
        if kv_tier is not None:
            self.kv.newly_cached = []
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order; the last in policy order is preempted first
        self._finished_ids: list[str] = []  # to tell the runner
        self._preempted_ids: dict[str, int] = {}
        self._sent_to_runner: set[str] = set()
        self._isolated: set[str] = set()  # requests whose next setup must be the only one in its step
        self._prefill_tokens_since_decode = 0
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats(config.num_speculative_tokens)
        self.spec_policy = SpecPolicy(config.spec_disable_by_batch_size)
        self._logged_pause = self._logged_batch_off = False

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue: at the end (fcfs), or at its (priority, arrival) place."""
        if self._by_priority:
            key = _priority_key(req)
            for i, other in enumerate(self.waiting):  # bounded by admission control: a short scan
                if _priority_key(other) > key:
                    self.waiting.insert(i, req)
                    return
        self.waiting.append(req)

    def _in_policy_order(self, reqs: Iterable[Request]) -> list[Request]:
        """Admission order (fcfs), else (priority, arrival) order; stable, so equal keys keep admission order."""
        reqs = list(reqs)
        return sorted(reqs, key=_priority_key) if self._by_priority else reqs


    def finish_request(self, req_id: str, reason: str = "abort") -> Request | None:
        """Ends a request from outside (abort, or a stop string found by the detokenizer)."""
        req = self.requests.get(req_id)
        if req is None or req.status.finished:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req, RequestStatus.from_finish_reason(reason))
        return req

    def preempt(self, req_id: str, resend_alone: bool = False) -> None:
        """Rolls a running request back to waiting; its KV is recomputed (after a step that failed).
        resend_alone: the runner sets the request up again, in a step with no other new request, so
        that a failure of that setup names it."""
        req = self.requests.get(req_id)
        if req is None or req not in self.running:
            return
        self._preempt(req)
        if resend_alone:
            self._sent_to_runner.discard(req_id)
            self._isolated.add(req_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        # A pooling request never decodes: it finishes with its last prompt chunk's step.
        decodable = [r for r in self.running if not r.is_prefilling and r.pooling_params is None]
        want_prefill = bool(self.waiting) or any(self._can_prefill(r) for r in self.running)
        out = None
        if want_prefill:
            used = self._prefill_tokens_since_decode if decodable else 0
            if used < self.config.max_num_batched_tokens:
                out = self._schedule_prefill(self.config.max_num_batched_tokens - used, whole=used > 0)
        if out is None and decodable:
            out = self._schedule_decode()
        if out is None and want_prefill:
            out = self._schedule_prefill()
        if out is not None:
            if out.kind == "decode":
                self._prefill_tokens_since_decode = 0
            else:
                self._prefill_tokens_since_decode += sum(len(c.token_ids) for c in out.chunks)
            out.finished_req_ids, self._finished_ids = self._finished_ids, []
            out.preempted_req_ids, self._preempted_ids = self._preempted_ids, {}
        return out

    def _schedule_prefill(self, budget: int | None = None, whole: bool = False) -> SchedulerOutput | None:
        """Up to `budget` tokens (default max_num_batched_tokens); `whole`: no request is split, the
        first that does not fit ends the batch (FCFS)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens if budget is None else budget
        full_budget = budget
        whole = whole or cfg.whole_prompts
        ctx_budget = cfg.max_prefill_context_tokens or cfg.max_model_len
        chunks: list[ScheduledChunk] = []
        new: list[NewRequestData] = []
        alone = False
        prefilling = self._in_policy_order(r for r in self.running if self._can_prefill(r))
        candidates = prefilling + list(self.waiting)
        loras = self._held_loras()
        for i, req in enumerate(candidates):
            if budget == 0:
                break
            admitted = req.status == RequestStatus.RUNNING
            if not admitted and len(self.running) >= cfg.max_num_seqs:
                break
            if new and (alone or req.request_id in self._isolated):
                break  # a request set up again after a failed step is the only new one in its step
            lora = _lora_id(req)
            if lora is not None and lora not in loras and len(loras) >= cfg.max_loras:
                continue  # its adapter would be one too many in the runner's slots: it waits for a holder to end
            if chunks and _wants_prompt_logprobs(req) != _wants_prompt_logprobs(self.requests[chunks[0].req_id]):
                break  # prompt logprobs steps run their graph eagerly: other requests keep the compiled one
            cached = None if admitted else \
                self.kv.empty_hit() if _skips_prefix_cache(req) else self.kv.find_cached_prefix(req)
            start = req.num_computed_tokens if admitted else cached.num_blocks * cfg.block_size
            if not admitted and self.kv_tier is not None and not _skips_prefix_cache(req):
                reading = self._admit_to_read_tier(req, cached, start)
                if reading is False:
                    break  # no blocks for it: FCFS
                if reading:
                    continue  # it prefills once its blocks are read
            if start > ctx_budget - sum(c.start_pos for c in chunks):
                break  # FCFS: later requests wait rather than overtake
            n = min(req.num_tokens - start, budget)
            if whole and n < req.num_tokens - start:
                break
            if cfg.split_prompts_at_buckets and not cfg.whole_prompts and n == req.num_tokens - start \
                    and not self._could_join_after(i, len(prefilling), len(candidates),
                                                   len(self.running) + (not admitted)):
                n = first_segment(full_budget - budget, n, cfg.prefill_buckets, cfg.prefill_step_overhead_tokens)
            if not joins_step(full_budget - budget, len(chunks), n, len(candidates) - i - 1,
                              cfg.prefill_buckets, cfg.prefill_step_overhead_tokens):
                break  # it starts the next step: the mean time to first token is lower so
            if not admitted:
                req.num_computed_tokens = start
            if not self.kv.allocate(req, n, cached):
                if not admitted:
                    req.num_computed_tokens = 0
                break
            if not admitted:
                self._admit(req, cached, start)
            if req.request_id not in self._sent_to_runner:  # (one admitted to read remote KV is sent here)
                self._sent_to_runner.add(req.request_id)
                if req.request_id in self._isolated:
                    self._isolated.discard(req.request_id)
                    alone = True
                new.append(NewRequestData(req.request_id, req.prompt_token_ids, req.sampling_params,
                                          req.eos_token_id, req.mm_items, req.prompt_embeds, req.pooling_params,
                                          req.lora_request))
                if lora is not None:
                    loras.add(lora)
            tokens = req.all_token_ids[start:start + n]
            sample = start + n == req.num_tokens
            chunks.append(ScheduledChunk(req.request_id, tokens, start, *self._tables(req.request_id),
                                         sample=sample))
            req.num_computed_tokens = start + n
            req.num_output_placeholders += sample
            budget -= n
        if not chunks:
            return None
        return SchedulerOutput("prefill", chunks, new)

    def _could_join_after(self, i: int, prefilling: int, candidates: int, running: int) -> bool:
        """Whether a candidate behind the i-th could still join this step, with `running` requests admitted. The
        candidates are `prefilling` running requests, then the waiting ones: a running one behind always could, a
        waiting one while there is room for it. Counts only: this runs for every candidate of every step."""
        return i + 1 < prefilling or (running < self.config.max_num_seqs and candidates > max(i + 1, prefilling))

    def _held_loras(self) -> set[int]:
        """Adapter ids the runner holds slots for: those of requests it has been sent and not told to end."""
        held = (self.requests.get(r) for r in self._sent_to_runner | self._isolated)
        return {i for i in map(_lora_id, held) if i is not None}

    def lora_names(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting ones), names sorted (vllm:lora_requests_info)."""
        def names(reqs) -> list[str]:
            return sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None})
        return names(self.running), names(self.waiting)

    def _admit(self, req: Request, cached, start: int) -> None:
        self.kv.record_prefix_lookup(req, cached)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = start

    def _victim(self) -> Request:
        """The running request last in policy order (fcfs: the newest) whose blocks no transfer is writing (the
        decoding one always qualifies)."""
        return next(r for r in reversed(self._in_policy_order(self.running)) if not self._loading(r.request_id))

    def _loading(self, req_id: str) -> bool:
        """Blocks of this request are being written by a read (from a remote instance or the second tier)."""
        return bool(self.kv_transfer and self.kv_transfer.is_loading(req_id)) or \
            bool(self.kv_tier and self.kv_tier.is_loading(req_id))

    def _can_prefill(self, req: Request) -> bool:
        return req.is_prefilling and not self._loading(req.request_id)

    # -- KV offloading: prefixes read back from the second tier (core/kv_tier.py) ----------------------
    def _admit_to_read_tier(self, req: Request, cached, start: int) -> bool | None:
        """Admits `req` to read the tier's blocks that continue its local hit (None: the tier has none for it;
        False: no blocks to read them into)."""
        found = self.kv_tier.extension(list(cached.hashes) or self.kv.prompt_hashes(req), cached.num_blocks)
        if not found:
            return None
        req.num_computed_tokens = start
        if not self.kv.allocate(req, len(found) * self.config.block_size, cached):
            req.num_computed_tokens = 0
            return False
        self._admit(req, cached, start)
        table = self.kv.block_table(req.request_id)
        self.kv_tier.start_load(req.request_id, found, table[cached.num_blocks:cached.num_blocks + len(found)])
        req.num_cached_tokens = start + len(found) * self.config.block_size
        return True

    def finish_tier_load(self, req_id: str, read: int) -> None:
        """A read from the second tier ended with `read` blocks from the first on: the request prefills from
        after them."""
        n, orphaned = self.kv_tier.finish_load(req_id, read)
        if orphaned is not None:
            self.kv.release_tables(orphaned)
        req = self.requests.get(req_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return  # aborted meanwhile (its blocks are already free)
        req.num_computed_tokens += n * self.config.block_size
        req.num_cached_tokens = req.num_computed_tokens
        self.kv.cache_computed_blocks(req)

    def take_tier_work(self) -> tuple[list, list[tuple[int, bytes]]]:
        """(reads to start, (block, hash) to write) since the last call."""
        self.kv_tier.cached(self.kv.newly_cached)
        self.kv.newly_cached.clear()
        return self.kv_tier.take()

    # -- disaggregated prefill/decode: a decode instance reads prompts' KV (core/kv_transfer.py) --------
    def take_kv_loads(self) -> list[KVLoadJob]:
        """Admits the waiting requests whose prompt was prefilled elsewhere, in arrival order while seats and
        blocks last: blocks for the whole prompt (after a local prefix hit), and a job to read those the hit
        does not cover. They prefill nothing until `finish_kv_load`."""
        jobs: list[KVLoadJob] = []
        if self.kv_transfer is None:
            return jobs
        for req in list(self.waiting):
            params = self.kv_transfer.remote_source(req)
            if params is None:
                continue
            if len(self.running) >= self.config.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(req)
            start = cached.num_blocks * self.config.block_size
            req.num_computed_tokens = start
            if not self.kv.allocate(req, req.num_tokens - start, cached):
                req.num_computed_tokens = 0
                break  # FCFS: blocks come back as requests finish
            self._admit(req, cached, start)
            job = self.kv_transfer.load_job(req, params, cached.num_blocks,
                                            [list(self.kv.block_table(req.request_id, g))
                                             for g in range(self.kv.num_groups)])
            if job is not None:
                jobs.append(job)
        return jobs

    def finish_kv_load(self, req_id: str, ok: bool) -> None:
        """The read of `req_id`'s prompt KV ended: read, its last prompt token prefills next; failed, the
        prompt prefills here from its local prefix hit (the same answer, later)."""
        orphaned = self.kv_transfer.finish_load(req_id, ok)
        if orphaned is not None:
            self.kv.release_tables(orphaned)
        req = self.requests.get(req_id)
        if req is None or req.status != RequestStatus.RUNNING:
            return  # aborted meanwhile (its blocks are already free)
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens - 1
            self.kv.cache_computed_blocks(req)

    def release_held(self, req_ids: list[str] | None = None) -> list[str]:
        """Frees the blocks held for remote readers: those of `req_ids` (read), else those whose hold timed
        out; returns the request ids freed."""
        held = self.kv_transfer.take_expired() if req_ids is None else self.kv_transfer.take_released(req_ids)
        for h in held:
            self.kv.release_tables(h.groups)
        return [h.request.request_id for h in held]

    def _schedule_decode(self) -> SchedulerOutput | None:
        scheduled: list[tuple[Request, list[int]]] = []
        batch_drafts = self._batch_allows_drafts()
        # Blocks go to requests in policy order, so a victim (the last in it) is never one already scheduled.
        for req in self._in_policy_order(self.running):
            if req.status != RequestStatus.RUNNING or req.is_prefilling or req.pooling_params is not None or \
                    self._will_finish(req):
                continue
            drafts = self._drafts(req) if self.spec_policy.take_step(req.request_id) and batch_drafts else []
            if drafts and not self.kv.allocate(req, 1 + len(drafts)):
                drafts = []  # blocks are short: verify nothing rather than preempt anyone for drafts
            if not drafts:
                while not self.kv.allocate(req, 1):
                    victim = self._victim()
                    self._preempt(victim)
                    if victim is req:
                        break
            if req.status == RequestStatus.RUNNING:
                scheduled.append((req, drafts))
        if not scheduled:
            return None
        chunks = []
        for r, drafts in scheduled:
            pos = r.num_computed_tokens
            # With async scheduling the token at `pos` may still be on the device (previous step).
            token = r.token_at(pos) if pos < r.num_tokens else PLACEHOLDER_TOKEN_ID
            chunks.append(ScheduledChunk(r.request_id, [token, *drafts], pos, *self._tables(r.request_id),
                                         sample=True, num_draft_tokens=len(drafts)))
            r.num_computed_tokens += 1 + len(drafts)
            r.num_output_placeholders += 1
            r.spec_token_ids = []
        out = SchedulerOutput("decode", chunks)
        if self.config.num_speculative_tokens:
            out.spec_req_ids = [r.request_id for r, _ in scheduled
                                if batch_drafts and self.spec_policy.wants_drafts_next(r.request_id)]
        return out

    def _batch_allows_drafts(self) -> bool:
        if self.spec_policy.batch_allows(len(self.running)):
            return True
        if not self._logged_batch_off:
            self._logged_batch_off = True
            logger.info("Speculative decoding off for steps with %d or more running requests "
                        "(speculative_config.disable_by_batch_size=%d); now %d",
                        self.spec_policy.disable_by_batch_size, self.spec_policy.disable_by_batch_size,
                        len(self.running))
        return False

    def _tables(self, req_id: str) -> tuple[list[int], tuple[list[int], ...]]:
        """(group 0's block table, the other groups' tables), copied: the runner may see them later."""
        return list(self.kv.block_table(req_id)), tuple(list(self.kv.block_table(req_id, g))
                                                        for g in range(1, self.kv.num_groups))

    def _drafts(self, req: Request) -> list[int]:
        """The request's drafts for this step, capped so every output they could yield is wanted."""
        if not req.spec_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            return []  # none, or the last token is still in flight
        cap = min(self.config.num_speculative_tokens, self.config.max_model_len - req.num_tokens - 1)
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            cap = min(cap, max_tokens - len(req.output_token_ids) - 1)
        return req.spec_token_ids[:max(cap, 0)]

    def _will_finish(self, req: Request) -> bool:
        """A pending sample already reaches a length cap: another step would be thrown away."""
        if not req.num_output_placeholders:
            return False
        n_out = len(req.output_token_ids) + req.num_output_placeholders
        max_tokens = req.sampling_params.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or \
            req.num_prompt_tokens + n_out >= self.config.max_model_len

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a sample in flight is dropped; the recompute samples again
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_ids[req.request_id] = len(req.output_token_ids)
        if self._by_priority:
            self._enqueue(req)
        else:
            self.waiting.appendleft(req)

    # -- results -----------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[FinishedRequest]:
        """Records computed tokens and sampled ones; returns the requests that finished."""
        finished = []
        for chunk in sched.chunks:
            req = self.requests.get(chunk.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            if chunk.sample:
                req.num_output_placeholders -= 1
            sampled = result.sampled.get(chunk.req_id, ())
            if chunk.num_draft_tokens and sampled:
                self._roll_back_rejected(req, chunk.num_draft_tokens, len(sampled) - 1)
            if not _skips_prefix_cache(req):
                self.kv.cache_computed_blocks(req)
            if req.pooling_params is not None:
                if chunk.sample:  # its last prompt chunk: the pooled output is its whole answer
                    self.running.remove(req)
                    self._free(req, RequestStatus.FINISHED_STOPPED)
                    finished.append(FinishedRequest(req, "stop", 0))
                continue
            for i, tok in enumerate(sampled):
                req.output_token_ids.append(tok)
                stop = check_stop(req.output_token_ids, req.sampling_params, req.eos_token_id,
                                  req.num_prompt_tokens, self.config.max_model_len)
                if stop is not None:
                    req.stop_reason = stop[1]
                    self.running.remove(req)
                    self._free(req, RequestStatus.from_finish_reason(stop[0]))
                    finished.append(FinishedRequest(req, stop[0], i + 1))
                    break
            if req.status == RequestStatus.RUNNING:
                req.spec_token_ids = list(result.spec_token_ids.get(chunk.req_id, ()))
        return finished

    def _roll_back_rejected(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Forgets the K/V of rejected drafts: their positions are rewritten by later tokens."""
        self.spec_stats.record(num_drafts, num_accepted)
        if self.spec_policy.record(req.request_id, num_drafts, num_accepted) and not self._logged_pause:
            self._logged_pause = True
            p = self.spec_policy
            logger.info("Speculative decoding paused for request %s: its last %d verifications accepted under "
                        "%d%% of their drafts; such a request decodes without drafts for %d..%d steps between "
                        "probes (logged once)", req.request_id, p.window, round(100 * p.min_acceptance),
                        p.initial_backoff, p.max_backoff)
        req.num_computed_tokens -= num_drafts - num_accepted
        self.kv.trim(req, req.num_computed_tokens)

    def _free(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        xfer = self.kv_transfer
        if xfer is not None and xfer.wants_hold(req, status.value):
            xfer.hold(req, self.kv.detach(req))  # freed when read (release_held)
        elif xfer is not None and xfer.is_loading(req.request_id):
            xfer.orphan(req.request_id, self.kv.detach(req))  # a transfer still writes them: freed when it ends
        elif self.kv_tier is not None and self.kv_tier.is_loading(req.request_id):
            self.kv_tier.orphan(req.request_id, self.kv.detach(req))
        else:
            self.kv.free(req)
        if xfer is not None:
            xfer.forget(req.request_id)
        self.spec_policy.remove(req.request_id)
        del self.requests[req.request_id]
        self._isolated.discard(req.request_id)
        if req.request_id in self._sent_to_runner:
            self._sent_to_runner.discard(req.request_id)
            self._finished_ids.append(req.request_id)
