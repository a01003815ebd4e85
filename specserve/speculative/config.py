"""``SpeculativeConfig``: which draft head, how many drafts, and how they are accepted."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("specserve")

METHODS = ("eagle3", "mtp")
MAX_DRAFT_LEN = 16  # longest draft chain a step may propose (the draft loop is unrolled up to it)
MAX_TOPK = 8  # children a tree node expands
MAX_TREE_NODES = 63  # a tree's nodes, and a tree step's expanded nodes: one bit each in an int64 ancestor mask
# steps of more rows draft chains (``tree_max_batch_size``): past a few rows a verify step's cost grows with its tokens
TREE_MAX_BATCH = 8
# other projects' spellings of the fields (SGLang, TensorRT-LLM, vLLM), accepted in a speculative_config dict
ALIASES = {"model": "draft_model", "speculative_model_dir": "draft_model", "num_speculative_tokens": "max_draft_len",
           "eagle_topk": "topk", "dynamic_tree_max_topK": "topk"}


@dataclass
class SpeculativeConfig:
    """Settings of one-model speculative decoding.

    Fields:
      method: ``"eagle3"`` (an EAGLE-3 head on three target layers) or ``"mtp"`` (DeepSeek-style
        multi-token-prediction modules on the target's final hidden state). None (the default): what the
        head folder's config.json or tensor names say it is (``checkpoint.head_kind``), else ``"eagle3"``;
        a method given explicitly overrides the folder's (with a warning when they differ).
      draft_model: folder holding the head (config.json + *.safetensors in the EAGLE-3 or MTP layout); also
        spelled ``model`` (vLLM) and ``speculative_model_dir`` (TensorRT-LLM).
      max_draft_len: D, drafts proposed per step (each step verifies D + 1 tokens).
      eagle3_layers_to_capture: target layers whose *outputs* (residual stream after the layer) feed an
        EAGLE-3 head. Default: ``(1, L//2 - 1, L - 4)``. Checkpoints from other tools store the
        equivalent *input* layer ids (``eagle_aux_hidden_state_layer_ids``, default ``(2, L//2, L-3)``);
        the loader converts them by subtracting one.
      mtp_eagle: MTP only. True runs the first MTP module D times autoregressively (MTP-Eagle); False
        runs module k at draft position k (vanilla, needs D <= number of modules). None picks
        MTP-Eagle when the checkpoint has fewer modules than D or drafts a tree, vanilla otherwise.
      forced_acceptance: performance experiments only. Accept this many drafts every step, whatever they
        are (a fractional value alternates between its floor and ceiling so the mean matches). BREAKS
        LOSSLESSNESS: outputs are no longer the target's.
      use_relaxed_acceptance_for_thinking: inside a reasoning model's thinking phase, accept a draft that
        is among the ``relaxed_topk`` most likely tokens with probability >= top-1 - ``relaxed_delta``
        (lossy by design, opt-in; requests can override these three per request). Outside the phase,
        acceptance stays lossless.
      begin_thinking_phase_token / end_thinking_phase_token: token ids, or strings that the tokenizer turns
        into exactly one token, that open and close the thinking phase (in the prompt or the output).

      topk: dynamic-tree drafting (EAGLE-2's rule) when > 1: at each of the ``max_draft_len`` depths the head
        expands the ``topk`` most likely children of the ``topk`` most likely nodes, and the
        ``max_total_draft_tokens`` nodes of highest cumulative draft probability form the tree the target
        verifies in one pass. 1 (the default): a chain of ``max_draft_len`` drafts. EAGLE-3 and MTP-Eagle heads;
        greedy and sampled acceptance (not relaxed or forced). Also spelled ``eagle_topk`` (SGLang) and
        ``dynamic_tree_max_topK`` (TensorRT-LLM); ``num_speculative_tokens`` is ``max_draft_len``.
      max_total_draft_tokens: nodes of a tree (at least ``max_draft_len``, at most 63); None: ``topk`` x
        ``max_draft_len`` capped at 63 (a chain: ``max_draft_len``).
      tree_max_batch_size: a step of more rows than this drafts a chain of ``max_draft_len`` (its next verify
        step then costs 1 + D tokens a row instead of 1 + N): a tree's wider verify step pays only where the
        step's cost hardly grows with its rows. None (the default): where the engine runs CUDA graphs, each step
        drafts the tree or a chain of 1..``max_draft_len`` drafts, whichever promises most tokens per second,
        from each option's step costs measured at engine start (kept in ``step_cost_file`` where given) and the
        acceptance the tree and the chains are getting (``speculative/tree_choice.py``); elsewhere, and for a
        tree of ``max_draft_len`` nodes (as wide as the chain: nothing to weigh), steps of more than
        ``TREE_MAX_BATCH`` rows draft chains of ``max_draft_len``.

      draft_len_schedule: TensorRT-LLM's batch-size schedule of the draft length, {batch size: D}: a step of B
        rows drafts the D of the smallest key >= B, and nothing (no speculation) past the largest key. Chains
        (topk=1) only. JSON object keys may be strings of integers.
      acceptance_rate_window_size / acceptance_rate_threshold: TensorRT-LLM's speculation gate: once the
        acceptance rate (accepted / drafted) over the last ``window`` speculative steps falls below the
        threshold (in [0, 1]), no step drafts again. Both or neither.
      adaptive_draft_len: each step drafts the D in 0..max_draft_len (at most the schedule's) of most expected
        tokens per second: the measured seconds of a step of its rows and that D, against the acceptance its
        requests are getting (``speculative/draft_len.py``). Chains only.
      step_cost_file: a JSON file that keeps the measured step costs (``adaptive_draft_len``'s, or a tree's and
        its chain's) between runs (per model, head, dtype, device, D or tree); the first run with it measures (a few
        seconds at engine start) and writes them.
    Outputs never depend on the draft length: every token is the target's.
    """

    method: str | None = None
    draft_model: str | None = None
    max_draft_len: int = 4
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    mtp_eagle: bool | None = None
    forced_acceptance: float | None = None
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    begin_thinking_phase_token: int | str | None = None
    end_thinking_phase_token: int | str | None = None
    topk: int = 1
    max_total_draft_tokens: int | None = None
    tree_max_batch_size: int | None = None
    draft_len_schedule: dict[int, int] | None = None
    acceptance_rate_window_size: int | None = None
    acceptance_rate_threshold: float | None = None
    adaptive_draft_len: bool = False
    step_cost_file: str | None = None

    def __post_init__(self) -> None:
        found = None
        if self.draft_model is not None and self.draft_model != "random":
            from specserve.speculative.checkpoint import head_kind

            found = head_kind(str(self.draft_model))
        if self.method is None:
            self.method = found or "eagle3"
        elif found is not None and found != self.method:
            log.warning("draft head %s is laid out as %s; method=%r overrides it", self.draft_model, found,
                        self.method)
        if not isinstance(self.relaxed_topk, int) or self.relaxed_topk < 1:
            raise ValueError(f"relaxed_topk must be an integer >= 1, got {self.relaxed_topk!r}")
        if not 0.0 <= float(self.relaxed_delta) <= 1.0:
            raise ValueError(f"relaxed_delta must be in [0, 1], got {self.relaxed_delta!r}")
        if self.use_relaxed_acceptance_for_thinking and self.begin_thinking_phase_token is None:
            raise ValueError("use_relaxed_acceptance_for_thinking needs begin_thinking_phase_token")
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; use one of {METHODS}")
        if (not isinstance(self.max_draft_len, int) or isinstance(self.max_draft_len, bool)
                or not 1 <= self.max_draft_len <= MAX_DRAFT_LEN):
            raise ValueError(f"max_draft_len must be an integer in [1, {MAX_DRAFT_LEN}], got {self.max_draft_len!r}")
        if self.eagle3_layers_to_capture is not None:
            layers = tuple(int(x) for x in self.eagle3_layers_to_capture)
            if len(layers) != 3 or min(layers) < 0:
                raise ValueError(f"eagle3_layers_to_capture needs three layer ids >= 0, got {layers}")
            if self.method != "eagle3":
                raise ValueError("eagle3_layers_to_capture applies to method='eagle3' only")
            self.eagle3_layers_to_capture = layers
        if self.mtp_eagle is not None and self.method != "mtp":
            raise ValueError("mtp_eagle applies to method='mtp' only")
        self._check_tree()
        self._check_draft_len()
        if self.forced_acceptance is not None and not 0 <= self.forced_acceptance <= self.max_draft_len:
            raise ValueError(
                f"forced_acceptance must be in [0, max_draft_len={self.max_draft_len}], got {self.forced_acceptance}"
            )

    def _check_tree(self) -> None:
        k, d = self.topk, self.max_draft_len
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOPK:
            raise ValueError(f"topk must be an integer in [1, {MAX_TOPK}], got {k!r}")
        if self.max_total_draft_tokens is None:
            self.max_total_draft_tokens = min(k * d, MAX_TREE_NODES)
        n = self.max_total_draft_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not d <= n <= MAX_TREE_NODES:
            raise ValueError(f"max_total_draft_tokens must be an integer in [max_draft_len={d}, {MAX_TREE_NODES}], "
                             f"got {n!r}")
        b = self.tree_max_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise ValueError(f"tree_max_batch_size must be an integer >= 0 or None (chosen by cost), got {b!r}")
        if k == 1 and n != d:
            raise ValueError(f"a chain (topk=1) verifies max_draft_len={d} drafts; max_total_draft_tokens={n} needs "
                             "topk > 1")
        if k > 1:
            candidates = k + (d - 1) * k * k
            if n > candidates:
                raise ValueError(f"max_total_draft_tokens={n}: a tree of depth {d} and topk {k} proposes only "
                                 f"{candidates} candidates")
            if k * (d - 1) > MAX_TREE_NODES:
                raise ValueError(f"topk x (max_draft_len - 1) = {k * (d - 1)} draft nodes to expand; at most "
                                 f"{MAX_TREE_NODES}")
            if self.use_relaxed_acceptance_for_thinking or self.forced_acceptance is not None:
                raise ValueError("tree drafting (topk > 1) takes greedy and sampled acceptance; relaxed and forced "
                                 "acceptance need topk=1")
            if self.mtp_eagle is False:
                raise ValueError("tree drafting (topk > 1) needs an EAGLE-3 or MTP-Eagle head, not vanilla MTP")

    def _check_draft_len(self) -> None:
        sched = self.draft_len_schedule
        if sched is not None:
            if not isinstance(sched, dict) or not sched:
                raise ValueError(f"draft_len_schedule must be a non-empty {{batch size: draft length}} dict, got "
                                 f"{sched!r}")
            try:
                sched = {int(b): int(d) for b, d in sched.items()}
            except (TypeError, ValueError):
                raise ValueError(f"draft_len_schedule needs integer batch sizes and draft lengths, got {sched!r}")
            bad = {b: d for b, d in sched.items() if b < 1 or not 0 <= d <= self.max_draft_len}
            if bad:
                raise ValueError(f"draft_len_schedule {bad}: batch sizes must be >= 1 and draft lengths in "
                                 f"[0, max_draft_len={self.max_draft_len}]")
            self.draft_len_schedule = sched
        w, t = self.acceptance_rate_window_size, self.acceptance_rate_threshold
        if (w is None) != (t is None):
            raise ValueError("the speculation gate needs both acceptance_rate_window_size and "
                             "acceptance_rate_threshold")
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"acceptance_rate_window_size must be an integer >= 1, got {w!r}")
        if t is not None and not 0.0 <= float(t) <= 1.0:
            raise ValueError(f"acceptance_rate_threshold must be in [0, 1], got {t!r}")
        if self.step_cost_file is not None and not (self.adaptive_draft_len or self.measures_tree_costs):
            raise ValueError("step_cost_file keeps the costs of adaptive_draft_len or of a tree chosen by cost "
                             "(tree_max_batch_size=None); set adaptive_draft_len=True or draft a tree")
        if self.tree and (sched is not None or self.adaptive_draft_len or w is not None):
            raise ValueError("draft_len_schedule, the speculation gate and adaptive_draft_len apply to chains "
                             "(topk=1); a tree's steps choose between the tree and a chain by measured cost, or by "
                             "tree_max_batch_size")

    @property
    def measures_tree_costs(self) -> bool:
        """Whether a tree's steps choose between the tree and a chain by measured cost (on CUDA graphs)."""
        return self.tree and self.tree_max_batch_size is None

    @property
    def varies_draft_len(self) -> bool:
        """Whether a step may draft fewer than ``max_draft_len`` (a schedule, the gate or adaptive choice)."""
        return (self.draft_len_schedule is not None or self.acceptance_rate_window_size is not None
                or self.adaptive_draft_len)

    # -- numbers derived from D (and the tree), computed here only -----------------------------------------------
    @property
    def tree(self) -> bool:
        """Dynamic-tree drafting (``topk`` > 1)."""
        return self.topk > 1

    @property
    def num_nodes(self) -> int:
        """N: draft tokens a row verifies per step (D for a chain, the tree's node count)."""
        return self.max_total_draft_tokens

    @property
    def verify_len(self) -> int:
        """N + 1: tokens a decoding row computes per step (its last token and the N drafts it verifies)."""
        return self.num_nodes + 1

    @property
    def lookahead_slots(self) -> int:
        """KV slots past a row's verified tokens that the draft loop writes, so the scheduler reserves them beyond a
        sampling request's tokens: a chain's D - 1 (drafts 2..D are written at last_pos + 1 .. last_pos + D - 1); a
        tree's topk x (D - 1) (each expanded node of depths 1 .. D - 1 writes its own slot)."""
        return self.topk * (self.max_draft_len - 1)

    @property
    def kv_slots_past_len(self) -> int:
        """KV slots a sequence at ``max_model_len`` tokens may still write (N verified drafts, then the draft
        loop's ``lookahead_slots``, and one spare; a chain's 2 D); the KV pool must hold them on top of
        ``max_model_len``."""
        return self.num_nodes + self.lookahead_slots + 1

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """Accept a config, a dict of its fields (vLLM style), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = set(cls.__dataclass_fields__)
            value = dict(value)
            given = {name: name for name in value}  # each field's spelling in the dict, for the error below
            for alias, name in ALIASES.items():
                if alias in value:
                    if name in value and value[name] != value[alias]:
                        raise ValueError(f"speculative_config gives both {given[name]}={value[name]!r} and "
                                         f"{alias}={value[alias]!r}")
                    value[name] = value.pop(alias)
                    given[name] = alias
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"unknown speculative_config fields {unknown}; known: {sorted(known)}")
            return cls(**value)
        raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {type(value).__name__}")


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Outputs of layers 1, L//2-1 and L-4 (the inputs of layers 2, L//2, L-3), clamped for tiny models."""
    top = num_layers - 1
    return (min(1, top), min(max(0, num_layers // 2 - 1), top), max(0, num_layers - 4))
