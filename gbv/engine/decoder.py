"""The per-sequence decoding state and one iteration step (docs/SPEC.md section 9).

:class:`Decoder` is the plain Hugging Face path: K cache rows, one target forward over K x (L+1)
tokens. :func:`gbv.engine.generate.stream_generate` drives it.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Collection, Sequence

import torch

from gbv.engine import cache as kv
from gbv.engine.sampling import SamplingConfig, process_logits, sample
from gbv.engine.stats import GenerationStats
from gbv.verify import TorchRandom, get_verifier, is_multi_path

logger = logging.getLogger("gbv")

AR = "ar"


def method_settings(method: str, num_paths: int, block_len: int) -> tuple:
    """What :func:`set_method` sets, as ``(method, verifier, num_paths, block_len)``: ``ar`` drafts
    nothing, single-path verifiers draft one path. (``auto`` keeps one per arm: looking the verifier
    up every iteration cost ~15 us from a cold cache.)"""
    if method == AR:
        return method, None, 0, 0
    return method, get_verifier(method), num_paths if is_multi_path(method) else 1, block_len


def set_method(decoder, method: str, num_paths: int, block_len: int) -> None:
    """Set what the next iterations of ``decoder`` run (both decoder kinds; ``auto`` switches per
    iteration)."""
    decoder.method, decoder.verifier, decoder.num_paths, decoder.block_len = method_settings(method, num_paths,
                                                                                              block_len)


def verifies_on_host(device: torch.device | str) -> bool:
    """Whether decoders on ``device`` verify on the host: off the CPU, unless ``GBV_VERIFY_ON_DEVICE=1``.

    Then each verify call copies its inputs to the host after one synchronisation
    (:func:`host_copies`) and runs the verifier's host form with a host generator (the decoder's
    ``verify_rng``). Why: on an H200 the device forms launch hundreds of small kernels; at K = 4,
    L = 8, V = 32k a call took 21 ms (SpecTr), 16 ms (Traversal), 14 ms (gbv-adaptive), 7 ms
    (SpecInfer), 2.1 ms (GBV), 0.9 ms (BV), where the host forms, reading the same CUDA tensors row
    by row, took 0.3-1.9 ms (docs/ENGINE.md, "The first GPU run"). The device forms stay, tested
    and one variable away, for batched verification on the device."""
    return torch.device(device).type != "cpu" and os.environ.get("GBV_VERIFY_ON_DEVICE", "0") != "1"


def host_copies(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the host, after one synchronisation: non-blocking copies (into pinned memory on
    CUDA), then one wait for the stream, where ``.cpu()`` each would wait once per tensor. Host
    tensors are returned as they are."""
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    device = next(t.device for t in tensors if t.device.type != "cpu")
    if device.type != "cuda":
        return tuple(t.cpu() for t in tensors)
    copies = tuple(t.to("cpu", non_blocking=True) for t in tensors)
    torch.cuda.current_stream(device).synchronize()  # the copies are read only after this
    return copies


def host_random(seed: int) -> TorchRandom:
    """The verifier's host random source for a decoder seeded with ``seed``: a CPU generator on a seed
    derived from it (not ``seed`` itself, which on the CPU would replay the drafts' own stream)."""
    return TorchRandom(seed=(seed * 0x9E3779B97F4A7C15 + 0x5EED) % 2**63)


class DecoderState:
    """What both decoders keep for one sequence: the method's settings (:func:`set_method`), the
    sampling configs, the seeded generator and its random source, the committed ``tokens``, the
    draft's ``draft_len`` and the :class:`GenerationStats`."""

    def __init__(self, method: str, num_paths: int, block_len: int, vocab: int, target_sampling: SamplingConfig,
                 draft_sampling: SamplingConfig, seed: int, device) -> None:
        set_method(self, method, num_paths, block_len)
        self.vocab = vocab
        self.target_sampling = target_sampling
        self.draft_sampling = draft_sampling
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.rng = TorchRandom(self.generator)
        # The verifier's random source: the decoder's own on the CPU; a host generator where the
        # verifier runs on the host for a device's models (verifies_on_host), so that its coins
        # and draws read nothing back from the device. (Its own stream: the law needs the verifier's
        # coins independent of the drafts, which a separate generator gives.)
        self.verify_on_host = verifies_on_host(self.device)
        self.verify_rng = host_random(seed) if self.verify_on_host else self.rng
        self.tokens: list[int] = []
        self.draft_len = 0
        # Set: the prompt's prefill leaves the draft unfed (AutoDecoder sets it); the first speculative
        # step feeds the draft everything it has not seen, as it does after any plain target step.
        self.defer_draft = False
        self.stats = GenerationStats(method=method, num_paths=self.num_paths, block_len=self.block_len,
                                     depth_accept_counts=[0] * self.block_len)

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Feed every prompt token but the last to both models (:meth:`_feed_prompt`)."""
        start = self._clock()
        self.tokens = list(prompt_ids)
        self._feed_prompt(self.tokens[:-1])
        self.draft_len = 0 if self.defer_draft else len(self.tokens) - 1
        self.stats.prompt_tokens = len(self.tokens)
        self.stats.time_prefill += self._clock() - start

    def _clock(self) -> float:
        return time.perf_counter()

    def verify(self, drafted, q, p, since: float):
        """Run the verifier (on the host where :func:`verifies_on_host`), time it from ``since`` and
        record the accepted length; the result."""
        if self.verify_on_host:
            drafted, q, p = host_copies(drafted, q, p)
        result = self.verifier(drafted, q, p, self.verify_rng)
        self.stats.time_verify += self._clock() - since
        self.stats.record_accept(result.accepted_len)
        return result

    def iteration_shape(self, block_len: int | None) -> tuple[int, int]:
        """``(block, rows)`` of the next iteration: ``block_len`` (<= the configured one) shortens the
        block (0 = a plain target step); a greedy draft makes K identical paths, so it drafts one (any
        K is lossless; this one is cheapest)."""
        block = self.block_len if block_len is None else min(block_len, self.block_len)
        return block, 1 if self.draft_sampling.greedy else self.num_paths


class Decoder(DecoderState):
    """The decoding state of one sequence and one iteration step on the plain Hugging Face path.
    Tests use it to inspect the caches (``target_cache`` holds ``tokens[:-1]``, ``draft_cache`` holds
    ``tokens[:draft_len]``; the draft still has to be fed ``tokens[draft_len:]``)."""

    def __init__(self, target, draft, method: str, num_paths: int, block_len: int, vocab: int,
                 target_sampling: SamplingConfig, draft_sampling: SamplingConfig, seed: int, device) -> None:
        super().__init__(method, num_paths, block_len, vocab, target_sampling, draft_sampling, seed, device)
        self.target = target
        self.draft = draft
        self.target_cache = kv.new_cache(target)
        self.draft_cache = kv.new_cache(draft) if self.verifier is not None else None
        self._target_kw = kv.cache_keyword(target)  # ``cache`` or ``past_key_values``: transformers' version
        self._draft_kw = kv.cache_keyword(draft) if draft is not None else "cache"

    def _ids(self, ids: Sequence[int] | torch.Tensor, rows: int = 1) -> torch.Tensor:
        tensor = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(1, -1)
        return tensor.expand(rows, -1) if rows > 1 else tensor

    def _feed_prompt(self, head: list[int]) -> None:
        if head:
            ids = self._ids(head)
            self.target(input_ids=ids, **{self._target_kw: self.target_cache}, use_cache=True, logits_to_keep=1)
            if self.draft_cache is not None and not self.defer_draft:
                self.draft(input_ids=ids, **{self._draft_kw: self.draft_cache}, use_cache=True, logits_to_keep=1)

    def step(self, block_len: int | None = None) -> list[int]:
        """One iteration; returns the newly committed tokens (the last one is the new pending token).
        ``block_len`` (<= the configured one) shortens this iteration's block; 0 = a plain target step."""
        block, rows = self.iteration_shape(block_len)
        if block <= 0:
            return self._target_step()
        stats = self.stats
        committed = len(self.tokens) - 1  # = target cache length

        # 1. draft K paths of `block` tokens, one batched forward per step.
        start = time.perf_counter()
        kv.replicate(self.draft_cache, rows)
        feed = self._ids(self.tokens[self.draft_len:], rows)
        drafted = torch.empty(rows, block, dtype=torch.long, device=self.device)
        q = torch.empty(rows, block, self.vocab, dtype=torch.float32, device=self.device)
        greedy = self.draft_sampling.greedy
        for i in range(block):
            logits = self.draft(input_ids=feed, **{self._draft_kw: self.draft_cache}, use_cache=True,
                                logits_to_keep=1).logits
            q_i = process_logits(logits[:, -1, :self.vocab], self.draft_sampling)
            x_i = sample(q_i, self.generator, greedy)
            q[:, i] = q_i
            drafted[:, i] = x_i
            feed = x_i[:, None]
        stats.draft_steps += block
        t_draft = time.perf_counter()
        stats.time_draft += t_draft - start

        # 2. score every path in one target forward.
        kv.replicate(self.target_cache, rows)
        pending = self._ids(self.tokens[-1:], rows)
        logits = self.target(input_ids=torch.cat([pending, drafted], dim=1), **{self._target_kw: self.target_cache},
                             use_cache=True).logits
        p = process_logits(logits[..., :self.vocab], self.target_sampling)
        stats.target_calls += 1
        t_target = time.perf_counter()
        stats.time_target += t_target - t_draft

        # 3. verify.
        result = self.verify(drafted, q, p, t_target)
        path, tau = result.path, result.accepted_len

        # 4. commit; keep the chosen row of each cache, cropped to the committed length.
        new = drafted[path, :tau].tolist() + [int(result.next_token)]
        self.tokens.extend(new)
        kv.select_row(self.target_cache, path)
        kv.crop(self.target_cache, committed + 1 + tau)
        kv.select_row(self.draft_cache, path)
        # The draft saw pending + x_1..x_{block-1}: it holds committed + block positions.
        self.draft_len = min(committed + block, committed + 1 + tau)
        kv.crop(self.draft_cache, self.draft_len)
        return new

    def _target_step(self) -> list[int]:
        start = time.perf_counter()
        logits = self.target(input_ids=self._ids(self.tokens[-1:]), **{self._target_kw: self.target_cache},
                             use_cache=True).logits
        probs = process_logits(logits[0, -1, :self.vocab], self.target_sampling)
        token = int(sample(probs[None], self.generator, self.target_sampling.greedy)[0])
        self.stats.target_calls += 1
        self.stats.time_target += time.perf_counter() - start
        self.tokens.append(token)
        return [token]

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens (after an EOS / stop string / token limit)."""
        if length >= len(self.tokens):
            return
        del self.tokens[length:]
        kv.crop(self.target_cache, length - 1)
        if self.draft_cache is not None:
            self.draft_len = min(self.draft_len, length - 1)
            kv.crop(self.draft_cache, self.draft_len)


def engine_for(target, draft) -> str:
    """``"tree"`` when both models run on the lean tree engine (the lean families:
    ``LEAN_ARCHITECTURES``), else ``"hf"``.
    ``GBV_ENGINE=hf`` in the environment forces the plain Hugging Face path (for comparisons)."""
    from gbv.engine.lean import lean_unsupported_reason

    if os.environ.get("GBV_ENGINE", "").lower() == "hf":
        return "hf"
    models = [m for m in (target, draft) if m is not None]
    reasons = [(m, lean_unsupported_reason(m)) for m in models]
    untold = [(m, reason) for m, reason in reasons if reason is not None and m not in _TOLD_PLAIN]
    if untold:  # (one line, once a model: why this pair decodes slower)
        _TOLD_PLAIN.update(m for m, _ in untold)
        why = "; ".join(dict.fromkeys(f"{type(m).__name__}: {reason}" for m, reason in untold))
        logger.warning("this pair runs on the plain Hugging Face path (slower: no token tree, a cache row per "
                       "path; docs/ENGINE.md, \"Two paths\"). %s", why)
    return "tree" if all(reason is None for _, reason in reasons) else "hf"


# The models whose fallback to the plain path engine_for has logged.
_TOLD_PLAIN: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def make_decoder(target, draft, method: str, num_paths: int, block_len: int, vocab: int,
                 target_sampling: SamplingConfig, draft_sampling: SamplingConfig, seed: int, device,
                 stop_tokens: Collection[int] = ()):
    """The decoder for this pair: :class:`~gbv.engine.tree_decoder.TreeDecoder` on the lean engine
    where both models support it, else the plain Hugging Face :class:`Decoder`; for ``auto``, either
    one wrapped in :class:`~gbv.engine.auto.AutoDecoder` (``num_paths`` / ``block_len`` are then
    ignored: the policy's arms set them per iteration). ``stop_tokens``: the ids that end the
    generation (its EOS ids), where the tree engine's runs of plain steps stop; the caller still
    applies every stop rule itself."""
    if method == "auto":
        from gbv.engine import auto

        arms = auto.default_arms(draft_sampling.greedy, draft is not None)
        key = (target_sampling, draft_sampling, vocab)
        if engine_for(target, draft) == "hf":  # (its own costs: GBV_ENGINE=hf may switch a pair's engine in a
            key += ("hf",)                     # process; the tree engine's key is the batch's, BatchRows.add)
        policy = auto.policy_for(target, draft, key, arms)
        speculative = [arm for arm in arms if arm.method != AR]
        if not speculative:
            return auto.AutoDecoder(make_decoder(target, None, AR, 1, 1, vocab, target_sampling, draft_sampling,
                                                 seed, device, stop_tokens), policy)
        first = speculative[0]
        base = make_decoder(target, draft, first.method, max(a.num_paths for a in speculative),
                            max(a.block_len for a in speculative), vocab, target_sampling, draft_sampling, seed,
                            device, stop_tokens)
        return auto.AutoDecoder(base, policy)
    if engine_for(target, draft) == "tree":
        from gbv.engine.tree_decoder import TreeDecoder

        return TreeDecoder(target, draft, method, num_paths, block_len, vocab, target_sampling, draft_sampling,
                           seed, device, stop_tokens=stop_tokens)
    return Decoder(target, draft, method, num_paths, block_len, vocab, target_sampling, draft_sampling, seed, device)
