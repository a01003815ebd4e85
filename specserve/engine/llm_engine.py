"""LLMEngine: owns the model, KV cache, scheduler and runner; ``step()`` advances every request once."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import itertools
import logging
import random
from typing import NamedTuple

import torch

from specserve.cache.kv_cache import BlockPool, KVCache, bytes_per_block, plan_num_blocks
from specserve.config import EngineArgs, EngineConfig, cdiv
from specserve.core.metrics import SpecStats, Tally, Verified
from specserve.core.request import CompletionOutput, Family, Logprob, Request, RequestOutput
from specserve.distributed import (Commands, TensorParallel, broadcast_object, free_port, from_torchrun,
                                   init_group, rank_device, start_workers)
from specserve.loaders import is_random_ref, load_model, resolve_model_path
from specserve.runner.model_runner import ModelRunner
from specserve.runner.sampler import parse_logprobs
from specserve.sampling_params import RequestOutputKind, SamplingParams
from specserve.scheduler.scheduler import Scheduler
from specserve.speculative.checkpoint import check_head_folder, load_draft_head
from specserve.speculative.step_costs import load_or_measure_costs
from specserve.speculative.speculator import Speculator
from specserve.speculative.tree import TreeSpeculator
from specserve.tokenizer import IncrementalDetokenizer

__all__ = ["EngineArgs", "EngineConfig", "LLMEngine"]  # EngineArgs lives in specserve.config, importable here

log = logging.getLogger("specserve")


class Collected(NamedTuple):
    """One request's part of a collected step (``LLMEngine._collect``), for ``_report``."""

    request: Request
    appended: list[int]  # tokens appended


class LLMEngine:
    def __init__(self, args: EngineArgs | EngineConfig, tp: TensorParallel | None = None,
                 address: str | None = None) -> None:
        """``tp`` and ``address``: given to the ranks other than 0 that rank 0 starts (``distributed.py``)."""
        # everything below reads the validated config only
        config = args.create_engine_config() if isinstance(args, EngineArgs) else args
        # an engine's start froze the heap: what it held is collectable again (an engine dropped since that a cycle
        # holds), and on a GPU collected before this one loads its weights, so that its device memory is free. On the
        # CPU the collector gets to it in its own time (a full collection at every start adds up in a process that
        # makes many engines, as the tests do)
        thawed = gc.get_freeze_count() > 0
        gc.unfreeze()
        self.tp, self.commands = self._join_ranks(args, config, tp, address)
        if self.commands is not None:
            atexit.register(self.shutdown)
        config = dataclasses.replace(config, device=rank_device(config.device, self.tp))
        if thawed and config.device.type == "cuda":
            gc.collect()
        self.spec_config = config.speculative_config
        # the files named exist (a typo fails now, not after the target's weights have loaded)
        if not is_random_ref(config.model):
            resolve_model_path(config.model)
        if self.spec_config is not None and self.spec_config.draft_model != "random":
            check_head_folder(self.spec_config.draft_model)
        if config.cpu_threads is not None:  # process-wide; measured in docs/BENCHMARKS.md ("CPU defaults")
            torch.set_num_threads(config.cpu_threads)
        self.device, self.dtype = config.device, config.dtype
        self.cache_config = config.cache_config
        loaded = load_model(config.model, self.dtype, self.device, self.tp)
        self.model, self.tokenizer, self.model_config = loaded.model, loaded.tokenizer, loaded.config
        self.model_path = loaded.path
        cfg = self.model_config
        self.head = None
        if self.spec_config is not None:
            self.head = load_draft_head(self.spec_config, self.model, self.device, self.dtype)
        # one KV tensor: target layers, then the head's layers; under tensor parallelism the target's hold this
        # rank's KV heads and the replicated head's layers all of them, in a tensor of their own
        block_size = self.cache_config.block_size
        head_layers = self.head.num_kv_layers if self.head is not None else 0
        own_head_kv = self.tp.active and head_layers > 0
        kv_layers = cfg.num_hidden_layers + (0 if own_head_kv else head_layers)
        kv_heads = self.tp.shard(cfg.num_key_value_heads, "KV heads")[1]
        per_block = bytes_per_block(kv_layers, block_size, kv_heads, cfg.head_dim, self.dtype)
        if own_head_kv:
            per_block += bytes_per_block(head_layers, block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype)
        # the head shares tensors with the target (RoPE tables, where bound, the embedding): count each once
        weights = {id(t): t for m in (self.model, self.head) if m is not None for t in (*m.parameters(), *m.buffers())}
        max_len = config.scheduler_config.max_model_len or cfg.max_position_embeddings
        num_blocks = plan_num_blocks(self.cache_config, per_block, self.device,
                                     sum(t.numel() * t.element_size() for t in weights.values()),
                                     seq_blocks=cdiv(max_len + config.kv_slots_past_len, block_size),
                                     max_num_seqs=config.scheduler_config.max_num_seqs)
        num_blocks = self.tp.smallest(num_blocks)  # every rank schedules the same blocks
        self.config = config = config.with_model(cfg, num_blocks)  # fixes max_model_len
        self.kv_cache = KVCache(kv_layers, num_blocks, block_size, kv_heads, cfg.head_dim, self.dtype, self.device)
        head_cache = KVCache(head_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, self.dtype,
                             self.device) if own_head_kv else self.kv_cache
        self.pool = BlockPool(num_blocks, block_size, caching=self.cache_config.enable_prefix_caching)
        self.max_model_len = config.max_model_len
        # a head's KV at a position reads the tokens after it: part of a cached block's key
        self.scheduler = Scheduler(config.scheduler_config, self.pool,
                                   key_after=self.head.num_kv_layers if self.head is not None else 0)
        self.thinking_tokens = self._thinking_tokens()
        runner_kwargs = dict(max_model_len=config.max_model_len, cuda_graph_max_rows=config.cuda_graph_max_rows,
                             capture_graphs=not config.enforce_eager,
                             attention_backend=config.attention_backend,
                             max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                             overlap=config.overlap_scheduler, max_num_seqs=config.scheduler_config.max_num_seqs)
        speculator = None
        if self.head is not None:  # the head's KV layers: after the target's, or (TP) in their own tensor
            head_kv = head_cache.layer_views()[-head_layers:]
            if self.spec_config.tree:  # the accepted path's target KV moves into place
                target_kv = self.kv_cache.tensor[:cfg.num_hidden_layers]
                speculator = TreeSpeculator(self.model, self.head, head_kv, target_kv, self.spec_config,
                                            self.kv_cache.block_size, self.thinking_tokens)
            else:
                speculator = Speculator(self.model, self.head, head_kv, self.spec_config, self.kv_cache.block_size,
                                        self.thinking_tokens)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, speculator=speculator, **runner_kwargs)
        # (with enforce_eager too: turning capture off changes nothing but the launches)
        self.scheduler.cfg.whole_prompts_together = self.runner.graphs is not None
        self.overlap = config.overlap_scheduler
        self.async_output = config.async_output or self.overlap  # overlap reports a step one call late too
        self._in_flight = None  # the step launched and not yet collected (``async_output``)
        self._error: Exception | None = None  # a failed launch after a collected step, raised by the next step()
        self.spec_stats = SpecStats()
        # the draft length of each step (``speculative/draft_len.py``), which counts the engine's acceptance itself
        self.draft_policy = speculator.policy if speculator is not None else None
        if self.draft_policy is not None:
            self.draft_policy.timed = not self.tp.active  # ranks' clocks differ; their choices must not
            options = speculator.cost_options(self.runner.graphs is not None)
            if options:  # rank 0's measurement: every rank chooses alike
                self.draft_policy.costs = broadcast_object(self.tp, load_or_measure_costs(self, options))
            elif self.spec_config.step_cost_file is not None:
                log.warning("step_cost_file %s unused: a tree's costs are measured only where the engine runs CUDA "
                            "graphs, and not for a tree of max_draft_len nodes", self.spec_config.step_cost_file)
        self.num_steps = 0  # model steps run (benchmarks)
        self.num_generated_tokens = 0  # tokens appended to requests, reported or not (the server's throughput log)
        self.requests: dict[str, Request] = {}
        self.families: dict[str, Family] = {}  # n > 1: the user's request id -> its completions
        self._ids = itertools.count()
        # the heap so far (modules, weights' wrappers, graphs: hundreds of thousands of objects) is static from here
        # on: out of the collector's reach, so that a full collection, which the objects a run makes set off inside
        # a step, no longer walks it (as vLLM does at start)
        gc.collect()
        gc.freeze()

    @staticmethod
    def _join_ranks(args, config: EngineConfig, tp: TensorParallel | None,
                    address: str | None) -> tuple[TensorParallel, Commands | None]:
        """Tensor parallelism: this process's rank, joined to the others (rank 0 starts them unless ``torchrun``
        did) -> (its rank, and on rank 0 the commands it sends the others before each step)."""
        size = config.tensor_parallel_size
        if tp is None:
            torchrun = from_torchrun()
            tp = torchrun or TensorParallel(0, size)
            if address is None and torchrun is not None:
                address = "env://"
        if tp.size != size:
            raise ValueError(f"tensor_parallel_size={size}, but this process is one of {tp.size} ranks")
        if not tp.active:
            return tp, None
        workers = []
        if address is None:  # rank 0 starts the others on this machine
            address = f"tcp://127.0.0.1:{free_port()}"
            workers = start_workers(args, size, address)
        init_group(tp, rank_device(config.device, tp), address)
        return tp, Commands(workers) if tp.rank == 0 else None

    def shutdown(self) -> None:
        """Tensor parallelism: stop the other ranks (rank 0; the engine is unusable after)."""
        if self.commands is not None:
            commands, self.commands = self.commands, None
            clean = all(p.is_alive() for p in commands.workers)
            if clean:
                commands.broadcast(final=True)
            for p in commands.workers:  # after a rank died the others wait for a command: they are ended
                p.join(timeout=60 if clean else 5)
                if p.is_alive():
                    p.terminate()
            torch.distributed.destroy_process_group()

    def _thinking_tokens(self) -> tuple[int, int]:
        """Ids of the begin/end thinking-phase tokens (-1 when not configured)."""
        spec = self.spec_config
        if spec is None:
            return (-1, -1)
        return tuple(self._token_id(getattr(spec, f), f) for f in ("begin_thinking_phase_token",
                                                                    "end_thinking_phase_token"))

    def _token_id(self, value: int | str | None, field: str) -> int:
        if value is None:
            return -1
        if isinstance(value, int):
            if not 0 <= value < self.model_config.vocab_size:
                raise ValueError(f"{field}={value} is outside the vocabulary")
            return value
        tid = self.tokenizer.hf.convert_tokens_to_ids(value)
        if isinstance(tid, int) and tid != self.tokenizer.hf.unk_token_id and tid >= 0:
            return tid
        ids = self.tokenizer.encode(value)
        if len(ids) != 1:
            raise ValueError(f"{field}={value!r} is {len(ids)} tokens for this tokenizer; it must be exactly one")
        return ids[0]

    # ------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request. Raises ``ValueError`` with a clear message for bad input; the engine and
        the requests already queued are unaffected."""
        params = params if params is not None else SamplingParams()
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(x) for x in prompt]
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = next((x for x in ids if not 0 <= x < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context is {self.max_model_len} "
                "(max_model_len): prompt plus at least one generated token must fit"
            )
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.requests or rid in self.families:
            raise ValueError(f"request id {rid!r} is already in use")
        max_total = self.max_model_len if params.max_tokens is None else min(self.max_model_len,
                                                                            len(ids) + params.max_tokens)
        if self.commands is not None:  # every rank adds it, with the seed chosen here
            if params.seed is None:
                params = dataclasses.replace(params, seed=random.getrandbits(31))
            self.commands.add("add", ids, params, rid)
        if params.n == 1:
            req = self._new_request(rid, text, ids, params, max_total)
            self.scheduler.add(req)
            return rid
        # n completions: the first computes the prompt, the others fork its KV once it has (Scheduler.fork_when_ready)
        members = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            sp = dataclasses.replace(params, n=1, seed=seed)
            members.append(self._new_request(f"{rid}-{i}", text, ids, sp, max_total))
        family = Family(rid, members)
        for i, m in enumerate(members):
            m.family, m.index = family, i
        self.families[rid] = family
        self.scheduler.add(members[0])
        for m in members[1:]:
            self.scheduler.fork_when_ready(members[0], m)
        return rid

    def _new_request(self, rid: str, text: str | None, ids: list[int], params: SamplingParams,
                     max_total: int) -> Request:
        req = Request(rid, text, ids, params, max_total, self.model_config.eos_token_ids, self.thinking_tokens)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        self.requests[rid] = req
        return req

    def abort_request(self, request_id: str) -> None:
        if self.commands is not None:
            self.commands.add("abort", request_id)
        family = self.families.pop(request_id, None)
        for rid in [m.request_id for m in family.members[::-1]] if family is not None else [request_id]:
            req = self.requests.pop(rid, None)
            if req is not None and not req.finished:
                req.finish("abort")
                self.scheduler.finish(req)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step not yet collected (under the overlap scheduler, one may hold only rows
        of requests that have ended since it was launched)."""
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that produced tokens.

        With ``async_output`` the step is left running on the device when this returns: the next call waits
        for it, appends its tokens, schedules and launches the step after it, and only then detokenizes and
        builds the outputs of the one it waited for, while the device runs the new one (the host's output work
        hidden behind the device). A call then reports the step launched by the call before it.

        With the overlap scheduler the next step is scheduled and launched before the running one is waited for:
        its rows that continue that step are scheduled as if it accepted every draft and corrected on the device
        (``Scheduler._view``, ``runner/overlap.py``); the running step is then collected, which sets the new
        step's rows to their true start and drafts (``ScheduledRequest.rebase``) and drops the rows of requests
        it finished. Outputs are those of synchronous steps (``tests/test_overlap.py``)."""
        if self._error is not None:  # the launch after the last collected step failed
            err, self._error = self._error, None
            raise err
        if self.commands is not None:  # the other ranks take the same requests and run the same step
            try:
                self.commands.broadcast()
                return self._step()
            except Exception as e:  # a collective with a rank that died: say which
                self.commands.check()
                raise e
        return self._step()

    def _step(self) -> list[RequestOutput]:
        """``step``'s work, on every rank alike."""
        pending, self._in_flight = self._in_flight, None
        done = []
        if pending is not None and not (self.overlap and self.runner.can_overlap(len(self.scheduler.running))):
            done, pending = self._collect(pending), None
        error = None
        try:
            batch = self.scheduler.schedule()
            if not batch.empty:
                self.num_steps += 1
                launched = self.runner.launch(batch)
                if self.overlap:
                    for s in batch.scheduled:
                        s.request.in_flight = s
                if self.async_output:
                    self._in_flight = launched
                else:
                    done += self._collect(launched)
        except Exception as e:  # report what was collected (requests it finished are done); raise on the next call
            error = e
        if pending is not None:
            done += self._collect(pending)
        if error is not None:
            if not done:
                raise error
            self._error = error
        reported = [(x.request, o) for x in done if (o := self._report(*x)) is not None]
        # a family whose last completions ended in this step is reported finished once, by its last output (and a
        # FINAL_ONLY family by that output alone)
        last = {o.request_id: i for i, (_, o) in enumerate(reported)}
        outs = []
        for i, (req, o) in enumerate(reported):
            o.finished = o.finished and last[o.request_id] == i
            if o.finished or req.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outs.append(o)
        return outs

    def _collect(self, launched) -> list[Collected]:
        """Wait for a launched step and apply its tokens: appended in order (nothing after the token that ends a
        request), finished requests released, the next drafts kept, and the rows of a step launched since that
        continue these set to their true start and drafts (or dropped, where the request ended). What the next
        schedule depends on is done here; the rest (detokenizing without stop strings, outputs, statistics) waits
        for ``_report``. -> a ``Collected`` per sampling row."""
        batch = launched.batch
        done = []
        proposed = None
        tally: Tally[Verified] = Tally()  # the engine's and the draft length's counts move once per kind of row
        for entry, res in self.scheduler.update(batch, self.runner.collect(launched)):
            req = entry.request
            if req.finished:  # aborted while its step ran
                continue
            if req.params.stop:  # a stop string can end the request at any token of the step
                appended = []
                for tok in res.tokens:
                    req.append_token(tok)
                    appended.append(tok)
                    self._detokenize(req, [tok])
                    if req.finished:
                        break
            else:
                appended = res.tokens[:req.append_tokens(res.tokens)]
            if req.logprobs is not None and res.logprobs is not None:
                req.logprob_rows += res.logprobs[:len(appended)]
            # drafts that could only land past the request's last allowed token are not verified
            room = max(0, req.max_total_tokens - req.num_tokens - 1)
            req.spec_token_ids, req.spec_parents = ([], None) if req.finished else res.next_drafts(room)
            after = req.in_flight  # its row in a step launched since (overlap scheduler)
            if after is not None and after is not entry:
                if req.finished:
                    after.discard = True
                elif after.after is entry:
                    after.rebase()
            if req.finished:
                req.in_flight = None
                self.scheduler.cache_blocks(req)  # its prompt and reply serve a follow-up turn
                self.scheduler.finish(req)
                self.requests.pop(req.request_id, None)
                if req.family is not None and req.family.finished:
                    self.families.pop(req.family.request_id, None)
            done.append(Collected(req, appended))
            if entry.num_drafts > 0:  # counted here, as the draft length's own counts are (``observe`` below), so
                # that its choice before the next launch sees the rows' counts and the engine's move together
                v = Verified(entry.num_drafts, res.num_accepted, len(appended), res.depth)
                req.spec_stats.record(*v)
                tally[v] += 1
            if self.draft_policy is not None and entry.sample:  # the drafts its step proposed
                req.spec_stats.record_step(entry.next_drafts)
                proposed = entry.next_drafts
        for s in batch.scheduled:
            if s.request.in_flight is s:
                s.request.in_flight = None
            if not s.discard and not s.request.finished:
                self.scheduler.cache_blocks(s.request)
        self.spec_stats.record_tally(tally)
        if self.draft_policy is not None and done:
            if proposed is not None:  # a step that sampled for some request still running or ended by it
                self.spec_stats.record_step(proposed)
            if tally:
                self.draft_policy.observe(tally)  # its own counts and the gate's; a tree's by kind of step
        return done

    def _report(self, req: Request, appended: list[int]) -> RequestOutput | None:
        """A collected step's output for one request: its text (unless stop strings detokenized it already) and
        statistics (counted at collection); None for a ``FINAL_ONLY`` request that goes on (its text is decoded
        once, when it ends)."""
        self.num_generated_tokens += len(appended)
        ended = req.finished if req.family is None else req.family.finished
        if req.params.output_kind == RequestOutputKind.FINAL_ONLY and not req.finished:
            return None  # its text and log-probabilities are made once, when it ends
        if not req.params.stop:
            n = req.num_output_tokens - req.detokenizer.added  # this step's tokens, or a FINAL_ONLY request's all
            if n:
                self._detokenize(req, req.token_ids[-n:])
        if req.logprob_rows:  # a row for each of the last tokens
            self._add_logprobs(req, req.token_ids[-len(req.logprob_rows):])
        # the text not reported yet, after stop strings; while one may still complete, the text it could begin
        # with is held back (a later token would cut the text there), as vLLM does
        end = len(req.output_text)
        if req.params.stop and not req.finished:
            end = max(req.text_sent, end - max(len(s) for s in req.params.stop) + 1)
        delta = req.output_text[req.text_sent:end]
        req.text_sent = end
        if req.params.output_kind == RequestOutputKind.FINAL_ONLY:
            if not ended:
                return None  # a completion of a family whose others go on: the family is reported when they end
            appended = req.output_token_ids  # its one report's delta is its completion's whole reply, as the text is
        return self._output(req, delta, appended)

    def _add_logprobs(self, req: Request, new_ids: list[int]) -> None:
        """The tokens appended since the last report: their log-probability rows -> ``Logprob`` dicts (the token
        and the request's ``logprobs`` most likely ones, each with its rank and text)."""
        k = req.params.logprobs
        for tok, row in zip(new_ids, req.logprob_rows):
            lp, rank, top = parse_logprobs(row, k)
            text = self.tokenizer.decode  # a token's own text, special tokens included
            entry = {tid: Logprob(v, j + 1, text([tid], skip_special_tokens=False)) for j, (tid, v) in enumerate(top)}
            entry.setdefault(tok, Logprob(lp, rank, text([tok], skip_special_tokens=False)))
            req.logprobs.append(entry)
        req.logprob_rows.clear()

    def _detokenize(self, req: Request, new_ids: list[int]) -> str:
        """Extend the request's text and apply stop strings (cutting the text, finishing the request)."""
        piece = req.detokenizer.add(new_ids)
        if req.finished:
            piece += req.detokenizer.flush()
        if not piece:
            return ""
        before = len(req.output_text)
        req.output_text += piece
        stops = req.params.stop
        if stops and req.finish_reason != "stop":
            longest = max(len(s) for s in stops)
            search_from = max(0, before - longest + 1)
            hits = [(idx, s) for s in stops if (idx := req.output_text.find(s, search_from)) >= 0]
            if hits:
                idx, s = min(hits)
                end = idx + len(s) if req.params.include_stop_str_in_output else idx
                req.output_text = req.output_text[:end]
                if not req.finished:
                    req.finish("stop", s)
                else:
                    req.finish_reason, req.stop_reason = "stop", s
        return req.output_text[before:]

    def _output(self, req: Request, delta: str = "", delta_ids: list[int] | None = None) -> RequestOutput:
        """The request's output, its deltas those of this step; of a family (n > 1): every completion, finished
        when all are, the deltas those of ``req`` (``delta_index``), metrics and statistics the first one's."""
        family = req.family
        members = [req] if family is None else family.members
        first = members[0]
        return RequestOutput(
            request_id=req.request_id if family is None else family.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            # snapshots, as the token ids are: a server thread reads this output while later steps append
            outputs=[CompletionOutput(m.index, m.output_text, m.output_token_ids, m.finish_reason, m.stop_reason,
                                      None if m.logprobs is None else list(m.logprobs)) for m in members],
            finished=req.finished if family is None else family.finished, metrics=first.metrics, delta_text=delta,
            delta_token_ids=list(delta_ids or []), delta_index=req.index,
            spec=first.spec_stats if self.spec_config is not None else None,
        )
