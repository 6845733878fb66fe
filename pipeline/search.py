"""Stage `search`: the recipe of build int4-mixed, by a mixed-precision fallback search.

Run by DVC: `python -m pipeline.search MODEL_DIR EVALS_DIR OUT_DIR PROFILE_DIR` (params block `search`; it
also reads `evaluate.harness`, `evaluate.serve`, `gate` and PROFILE_DIR/<fp16, search.base>.json).

INT4 damage is not spread evenly over a model: a few Linear layers cost most of it. The search keeps the
fewest most sensitive layers in 16-bit (the recipe's `ignore`) such that every team still passes, as
Intel Neural Compressor's accuracy-aware op fallback and NVIDIA ModelOpt's auto_quantize (where "do not
quantize" is one of the choices) do; llm-compressor has no such search yet (its RFC #2690).

1. Sensitivity, in-process: each Linear the base recipe quantizes is quantized alone, round-to-nearest
   at the recipe's weight scheme (bits, group size, symmetry) with the recipe's own observer
   (quantized_weights: min-max, or llm-compressor's imatrix_mse given E[x^2] of each input channel over
   the conversations quantize.<build>.calibration names, as quantize's calibration pass gives it). Its
   score is KL(p_16bit || p_quantized) of the next-token distributions, mean over the tokens of the first
   `kl_samples` calibration conversations (`kl_seq_len` tokens each).
2. A bisection over k, the number of top-ranked units kept 16-bit. A unit is one layer, or the layers
   vLLM loads as one fused module (`search.fused`: q/k/v_proj as qkv_proj, gate/up_proj as gate_up_proj),
   which vLLM needs at one scheme ("Found different quantization schemes for the shards of ...qkv_proj"
   otherwise: the server does not start); its sensitivity is its members' summed KL. A candidate is the
   16-bit model with every other targeted layer round-to-nearest quantized. It is screened in-process (lm-eval's hf
   backend) against the 16-bit build on the same documents, sequentially (quantgate/screening.py): on
   the first `looks[0]` documents of each task, then `looks[1]`, ..., judged by the gate's own interval
   (quantgate/judging.py) at a confidence spent over the looks, until each team is decided within or beyond
   its margin. A screen that runs out of looks, of a team's documents or of `doc_budget` (candidate
   documents scored over the whole search) is undecided, and is never taken as a pass. k = 0 is screened
   first, then the interval (largest k not shown to pass, smallest passing k) is cut at its geometric mean,
   since sensitivity is concentrated in few layers; k = every layer is the 16-bit build itself and is
   never screened. With `max_bits_per_weight` (default 6, the most an int4-class build may hold), k stops
   at the largest count within it, which is screened second: when it is not shown to pass, nothing
   within the bound is (more layers kept never loses quality, the bisection's own assumption), and the
   search ends after two screens. The search stops when the interval closes or the budget ends.
   Cheapest by what it buys: each candidate is priced at the gate's figure, cost per output token, relative
   to the 16-bit build's (quantgate/cost.py; the device-hour price scales every build alike), its time per
   token interpolated by weight share between the 16-bit build's and the base build's (search.base, int4)
   throughput as the profile stage measured them on the serving platform (Pricing). Where the quantized
   kernel is the faster one (GPUs: decoding streams fewer bytes), the two are within
   search.min_speed_difference, or nothing was measured (then by bits per weight), fewer kept layers is
   cheaper: the bisection above. Where it is the slower one (vLLM CPU's W4A16 against its bfloat16 GEMMs),
   every kept layer makes a candidate cheaper, so the cheapest is the most the bound allows (never every
   layer), and it is the only screen: it passes, or nothing does.
3. Out: OUT_DIR/recipe.yaml, the base recipe with the chosen kept layers added to `ignore` by exact
   module name, which quantize@int4-mixed makes with the base recipe's own method (GPTQ) and calibration;
   evaluate and the gate then confirm it on the full sets like any build. For a round-to-nearest recipe
   (int4's) the screened candidate has the weights quantize makes; for a GPTQ or AWQ recipe it is their
   round-to-nearest stand-in, which loses at least as much on most layers, so the screen errs towards keeping
   layers.
   OUT_DIR/search.json (DVC metrics; quantgate.results.SearchResult) and OUT_DIR/trace.md: the ranking,
   every screened candidate with its per-team results, estimated cost, the choice, effective bits per weight
   and size. The gate prints the chosen candidate's estimate beside int4-mixed's measured cost.
   If no screened candidate passes, the search says so and keeps no layer 16-bit: an unproven candidate
   is not a build. int4-mixed then has the base recipe's weights (int4's: quantize reuses them and
   evaluate its scores, so it costs no quantize or scoring time) and the gate FAILs it with that reason.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import yaml

from quantgate.console import progress
from quantgate.conversations import CALIBRATION_FILE, Calibration, calibration_texts
from quantgate.cost import mixed_seconds_per_token
from quantgate.errors import QuantgateError, run_main
from quantgate.executor import ExecutorParams, connect
from quantgate.jsonl import read_jsonl
from quantgate.judging import GateBlock, judge
from quantgate.params import BASELINE_BUILD, PARAMS_FILE, Frozen, load_block, load_builds, read_yaml, where
from quantgate.precision import model_context, native_16bit, probe, resolve_dtype, w4a16_problem
from quantgate.recipes import bits_per_weight, check_group_size, load_recipe, weight_schemes
from quantgate.remote import folder_files, node_python, on_node, published, settle, submit
from quantgate.results import Screen, SearchResult, TeamScores, read_profile, read_search, rounded, write_search
from quantgate.scoring import HarnessParams, run_team
from quantgate.screening import Budget, Outcome, look_confidence, sequential
from quantgate.search_params import SearchParams, check_base
from quantgate.serving import ServeParams
from quantgate.stats import Verdict
from quantgate.teams import Team, load_teams

RECIPE, RESULT, TRACE = "recipe.yaml", "search.json", "trace.md"


def rtn(weight, args):
    """`weight` (out_features, in_features) round-to-nearest quantized and dequantized at QuantizationArgs
    `args` (strategy group or channel), same shape and dtype. Min/max include 0, as llm-compressor's
    min-max observer does. Raises QuantgateError for other strategies."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    rows, cols = weight.shape
    if args.strategy == "group":
        view = weight.reshape(rows, cols // args.group_size, args.group_size)
        low, high = view.amin(-1), view.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        raise QuantgateError(
            f"search.recipe: weight strategy {args.strategy!r} not supported by the search; use group or channel"
        )
    zero = torch.zeros_like(low)
    scale, zero_point = calculate_qparams(torch.minimum(low, zero), torch.maximum(high, zero), args)
    return fake_quantize(weight, scale, zero_point, args)


MIN_MAX = (None, "minmax", "memoryless_minmax", "static_minmax")  # observers rtn reproduces (llm-compressor's)


def quantized_weights(model, linears: dict, args, batches: list) -> dict:
    """{layer: its weight fake-quantized as quantize makes it}: at `args` (the recipe's weight scheme) with the
    recipe's own observer, same shape and dtype as the weight. A min-max observer is rtn. Any other (e.g.
    imatrix_mse: scales chosen by a grid search of the error weighted by E[x^2] of each input channel) is
    llm-compressor's own, from its registry, given the activations of one 16-bit forward pass over `batches`
    (token id tensors (1, tokens): the conversations quantize calibrates on), as its calibration pass gives
    them. Screening with min-max stand-ins for an imatrix_mse recipe overstated the loss about twice on
    billing (session 19: +0.225 at 51 layers kept vs +0.11 for the real int4 with none kept)."""
    import torch
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor.observers import Observer

    if args.observer in MIN_MAX:
        return {name: rtn(m.weight.data, args) for name, m in linears.items()}
    observers = {
        name: Observer.load_from_registry(args.observer, base_name="weight", args=args.model_copy(deep=True))
        for name in linears
    }
    for name, m in linears.items():
        observers[name].attach(m)  # collects what the observer reads from activations (a no-op for most)
    try:
        with torch.no_grad():
            for ids in progress(batches, desc=f"search: {args.observer} statistics", unit="conversation"):
                model(input_ids=ids, use_cache=False)
    finally:
        for name, m in linears.items():
            observers[name].detach(m)
    out = {}
    with torch.no_grad():
        for name, m in linears.items():
            observer = observers[name]
            observer(m.weight.data)
            q = observer.get_qparams()
            out[name] = fake_quantize(m.weight.data, q["scale"], q["zero_point"], args)
    return out


def effective_bits(layers: dict[str, tuple[int, int]], kept: set[str], args) -> float:
    """Mean stored bits per weight over the targeted Linear layers (`layers`: name -> (weights,
    in_features)), layers in `kept` at 16 bits."""
    total = sum(n for n, _ in layers.values())
    bits = sum(n * (16 if name in kept else bits_per_weight(args, cols)) for name, (n, cols) in layers.items())
    return bits / total


def size_mib(model, layers: dict[str, tuple[int, int]], kept: set[str], args) -> float:
    """Estimated weights of the build in MiB: targeted layers not kept at `bits_per_weight`, every other
    parameter (embeddings, norms, kept layers) at 16 bits; tied parameters counted once."""
    quantized = {name for name in layers if name not in kept}
    bits = 0.0
    for name, param in model.named_parameters():  # named_parameters() yields a tied tensor once
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            bits += param.numel() * bits_per_weight(args, layers[module][1])
        else:
            bits += param.numel() * 16
    return bits / 8 / 2**20


def calibration_ids(tokenizer, path: Path, samples: int, seq_len: int, field: str = "search.kl_samples") -> list:
    """The first `samples` calibration conversations of `path`, tokenized, each a (1, <= seq_len) tensor.

    Raises QuantgateError if the file is missing, malformed or short (quantgate.calibration), naming `field`."""
    return [
        tokenizer(t, return_tensors="pt", add_special_tokens=False, truncation=True, max_length=seq_len).input_ids
        for t in calibration_texts(path, samples, field)
    ]


class QuantizeBlock(Frozen):
    """What the search reads of params.yaml quantize.<search.build>: its calibration (the rest is quantize's)."""

    model_config = {**Frozen.model_config, "extra": "ignore"}
    calibration: Calibration | None = None


class Pricing(Frozen):
    """What a candidate costs to serve relative to the 16-bit build, estimated before it exists (issue 32:
    cheapest by what it buys): the 16-bit build's and the base build's seconds per output token as the profile
    stage measured them on the serving platform, at the same concurrency (the largest both profiled, which the
    gate prices). The gate's $ per 1M output tokens is the device-hour price times seconds per token, so the
    ratio to the 16-bit build's is the price-free part: a `cost` change never re-runs the search. Without both
    figures (`source` says which is missing) the search prices by bits per weight."""

    baseline_s: float | None = None  # seconds per output token per device, the 16-bit build
    quantized_s: float | None = None  # the same for the base build (every targeted layer quantized)
    concurrency: int | None = None  # requests in flight both were measured at
    noise: float = 0.0  # search.min_speed_difference: a smaller relative difference counts as none
    source: str = ""  # the two profile files and figures, or why the search prices by bits instead

    @property
    def measured(self) -> bool:
        return self.baseline_s is not None and self.quantized_s is not None

    @property
    def kept_is_cheaper(self) -> bool:
        """A layer kept 16-bit makes a candidate cheaper per token: the quantized kernel was measured slower by
        more than the noise (vLLM CPU's W4A16 path against its bfloat16 GEMMs, benchmarks/README)."""
        return self.measured and self.quantized_s > self.baseline_s * (1 + self.noise)

    @property
    def kept_is_dearer(self) -> bool:
        """A layer kept 16-bit makes a candidate dearer: the quantized kernel measured faster beyond the noise."""
        return self.measured and self.quantized_s < self.baseline_s * (1 - self.noise)

    def ratio(self, quantized_fraction: float) -> float | None:
        """Estimated cost per output token of a candidate with `quantized_fraction` of its targeted weights
        quantized, as a multiple of the 16-bit build's (quantgate.cost.mixed_seconds_per_token); None without
        measurements."""
        if not self.measured:
            return None
        return mixed_seconds_per_token(self.baseline_s, self.quantized_s, quantized_fraction) / self.baseline_s


def base_build(p: SearchParams, builds: list[str]) -> str | None:
    """search.base when it is a build of this run, else None (the candidates are then priced by bits).
    Raises QuantgateError naming params.yaml's search.base when that build is made with another recipe."""
    if p.base not in builds:
        return None
    check_base(p, read_yaml(PARAMS_FILE).get("quantize") or {}, PARAMS_FILE)
    return p.base


def throughputs(profile_dir: Path, build: str) -> tuple[dict[int, float] | None, str]:
    """({concurrency: output tokens/s} measured for `build` in `profile_dir`/<build>.json, "") or (None, why
    not: unreadable, another build's record, unprofiled, no load, or no positive finite throughput)."""
    path = profile_dir / f"{build}.json"
    try:
        profile = read_profile(path)
    except QuantgateError as exc:
        return None, f"{path} unreadable ({exc})"
    if profile.build != build:
        return None, f"{path} holds build {profile.build}'s profile, not {build}'s"
    if profile.status != "profiled" or not profile.loads:
        return None, f"{build} has no measured load ({profile.reason or 'none in ' + str(path)})"
    measured = {p.concurrency: p.output_tokens_per_s for p in profile.loads.values()}
    if bad := sorted(c for c, t in measured.items() if not (math.isfinite(t) and t > 0)):
        return None, f"{path}: the profile measured no output tokens at {bad} in flight"
    return measured, ""


def pricing(profile_dir: Path, p: SearchParams, builds: list[str]) -> Pricing:
    """The search's Pricing from `profile_dir`/<build>.json of the 16-bit build and search.base (dvc.yaml lists
    both as the stage's deps, so DVC profiles them first), at the largest concurrency both measured. A missing,
    unreadable, unprofiled or mismatched record is no error: the search then prices by bits per weight and the
    trace says why. Raises QuantgateError for a search.base made with another recipe (base_build)."""
    base = base_build(p, builds)
    if base is None:
        return Pricing(source=f"search.base {p.base} is not a build of this run")
    (fp16, why16), (quantized, whyq) = throughputs(profile_dir, BASELINE_BUILD), throughputs(profile_dir, base)
    if fp16 is None or quantized is None:
        return Pricing(source="; ".join(w for w in (why16, whyq) if w))
    common = set(fp16) & set(quantized)
    if not common:
        return Pricing(
            source=f"{BASELINE_BUILD} and {base} were profiled at different concurrencies ({sorted(fp16)} vs "
            f"{sorted(quantized)}); re-run their profiles with one profile.concurrency"
        )
    c = max(common)
    return Pricing(
        baseline_s=1 / fp16[c],
        quantized_s=1 / quantized[c],
        concurrency=c,
        noise=p.min_speed_difference,
        source=(
            f"{profile_dir / BASELINE_BUILD}.json and {profile_dir / base}.json: {fp16[c]:.1f} and {quantized[c]:.1f} "
            f"output tokens/s per device at {c} in flight"
        ),
    )


def quantized_fraction(layers: dict[str, tuple[int, int]], kept: set[str]) -> float:
    """The share of the targeted weights (`layers`: name -> (weights, in_features)) quantized, `kept` at 16 bits."""
    total = sum(n for n, _ in layers.values())
    return sum(n for name, (n, _) in layers.items() if name not in kept) / total


def ranked_on(path: Path, samples: int, seq_len: int) -> str:
    """Which text the KL ranking read, for the trace: the first `samples` conversations of `path` (up to
    `seq_len` tokens each) and where they came from (each row's "source": a team's calibration.jsonl or the
    recorded set)."""
    rows = [row for _, row in zip(range(samples), read_jsonl(path, "re-run the calibrate stage"), strict=False)]
    sources = sorted({str(row.get("source", "?")).rsplit(":", 1)[0] for _, row in rows if isinstance(row, dict)})
    return f"the first {len(rows)} conversations of {path} (<= {seq_len} tokens each), from {', '.join(sources)}"


class BlockCache:
    """Forward passes that start at a decoder block, from the block inputs a reference pass recorded
    (`reference`: that pass's logits, one (1, tokens, vocab) tensor per batch).

    A Linear in block i leaves blocks 0..i-1 unchanged, so its quantized pass can start at block i: about
    half the work of a full pass on average. Works for models laid out as `model.model.layers` (decoder
    blocks returning the hidden states), `model.model.norm` and `model.lm_head` (Llama, Mistral, Qwen2,
    SmolLM2); for any other layout `start_of` is 0 and `logits` is the whole forward pass.
    """

    def __init__(self, model, batches: list):
        import torch

        self.model, self.batches = model, batches
        inner = getattr(model, "model", None)
        self.blocks = getattr(inner, "layers", None)
        self.norm = getattr(inner, "norm", None)
        if self.norm is None or getattr(model, "lm_head", None) is None:
            self.blocks = None
        self.inputs: list[list] = [[] for _ in batches]  # [batch][block] = (args, kwargs)
        current: list = []
        hooks = [
            block.register_forward_pre_hook(lambda _m, a, kw: current.append((a, kw)), with_kwargs=True)
            for block in (self.blocks or [])
        ]
        try:  # one full pass per batch records the block inputs and gives the reference logits
            with torch.no_grad():
                self.reference = []
                for b, ids in enumerate(batches):
                    current.clear()
                    self.reference.append(model(input_ids=ids, use_cache=False).logits)
                    self.inputs[b] = list(current)
        finally:
            for h in hooks:
                h.remove()

    def start_of(self, name: str) -> int:
        """The decoder block a module named `name` (e.g. model.layers.11.mlp.down_proj) is in, else 0."""
        parts = name.split(".")
        if self.blocks is None or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return 0
        return int(parts[2])

    def logits(self, b: int, start: int):
        """Logits (1, tokens, vocab) of batch `b`, computed from block `start` on."""
        if self.blocks is None or start == 0:
            return self.model(input_ids=self.batches[b], use_cache=False).logits
        args, kwargs = self.inputs[b][start]
        hidden = args[0]
        for j in range(start, len(self.blocks)):
            a, kw = self.inputs[b][j]
            out = self.blocks[j](hidden, *a[1:], **kw)
            hidden = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(self.norm(hidden))


def sensitivity(model, linears: dict, quantized: dict, batches: list) -> dict[str, float]:
    """{layer: KL(p_16bit || p_layer-quantized) in nats per token}, most sensitive first.

    `linears`: name -> torch.nn.Linear of `model`; each gets its `quantized` weight alone (quantized_weights)
    and is restored. `batches`: token id tensors (1, tokens). Each quantized pass starts at the layer's own
    decoder block (BlockCache).
    """
    import torch

    with torch.no_grad():
        cache = BlockCache(model, batches)
        reference = [logits.float().log_softmax(-1) for logits in cache.reference]
        probs = [r.exp() for r in reference]  # once, not once per layer
        tokens = sum(r.shape[1] for r in reference)
        scores = {}
        for name, layer in progress(list(linears.items()), desc="search: sensitivity", unit="layer"):
            original = layer.weight.data
            layer.weight.data = quantized[name]
            kl = 0.0
            for b, (ref, prob) in enumerate(zip(reference, probs, strict=True)):
                logp = cache.logits(b, cache.start_of(name)).float().log_softmax(-1)
                kl += float((prob * (ref - logp)).sum())
            layer.weight.data = original
            scores[name] = kl / tokens
    return dict(sorted(scores.items(), key=lambda kv: -kv[1]))


def units(ranking: dict[str, float], fused: dict[str, list[str]]) -> list[list[str]]:
    """The layers of `ranking` ({layer: KL}, most sensitive first) as the units the search keeps 16-bit or
    quantizes together, most sensitive first. The members of one `fused` group under one parent module
    (e.g. model.layers.1.self_attn.{q,k,v}_proj) are one unit, since vLLM loads them as one module at one
    scheme; any other layer is a unit alone. A unit ranks by its members' summed KL (small independent
    perturbations add, to second order); members keep their ranking order. Ties keep the ranking's order."""
    member_of = {leaf: name for name, leaves in fused.items() for leaf in leaves}
    groups: dict[str, list[str]] = {}
    for layer in ranking:
        parent, _, leaf = layer.rpartition(".")
        groups.setdefault(f"{parent}.{member_of[leaf]}" if leaf in member_of else layer, []).append(layer)
    return sorted(groups.values(), key=lambda g: -sum(ranking[n] for n in g))


def next_k(lo: int, hi: int) -> int:
    """The next count to screen between a failing `lo` and a passing `hi` (hi - lo >= 2): their geometric
    mean (lo counted as 1), strictly inside the interval."""
    mid = round(math.sqrt(max(lo, 1) * hi))
    return min(max(mid, lo + 1), hi - 1)


def bisect(n_units: int, screen, top: int | None = None, kept_is_cheaper: bool = False) -> list[Screen]:
    """Screens in the order run: k = 0, then the interval (largest k not shown to pass, smallest passing k) is
    cut (next_k) until it closes or the budget ends. `screen(k) -> Screen | None` keeps the top k units (None:
    the document budget cannot start it); k = n_units (all 16-bit) passes by construction, never screened.
    A failed or undecided screen both move the interval up: neither shows that k layers are enough.
    `top` (< n_units): the most units a candidate may keep (search.max_bits_per_weight); it is screened
    right after k = 0, and when it is not shown to pass, the search ends there: fewer kept layers lose more.
    `kept_is_cheaper` (Pricing.kept_is_cheaper: the quantized kernel is the slower one here): the cost falls as
    k grows, so the cheapest candidate is the most units allowed (`top`, at most n_units - 1: all 16-bit is the
    16-bit build), and it is the only one screened: if it passes nothing cheaper exists, and if it does not, no
    smaller k passes either."""
    if kept_is_cheaper:
        most = n_units - 1 if top is None else min(top, n_units - 1)
        return [s] if most > 0 and (s := screen(most)) is not None else []
    done = [s] if (s := screen(0)) is not None else []
    if not done or done[0].passed:
        return done
    lo, hi = 0, n_units
    if top is not None and top < n_units:
        if top == 0 or (s := screen(top)) is None:
            return done
        done.append(s)
        if not s.passed:
            return done
        hi = top
    while hi - lo >= 2:
        k = next_k(lo, hi)
        if (s := screen(k)) is None:
            break
        done.append(s)
        lo, hi = (lo, k) if s.passed else (k, hi)
    return done


def top_units(bits: list[float], max_bits: float | None) -> int | None:
    """The most units a candidate may keep 16-bit: the largest k with `bits[k]` (effective bits per weight
    with the top k units kept, growing in k) <= `max_bits`; None without a bound. Raises QuantgateError
    when the base recipe itself (k = 0) is over it."""
    if max_bits is None:
        return None
    if bits[0] > max_bits:
        raise QuantgateError(
            f"search.max_bits_per_weight {max_bits:g} is below the base recipe's own {bits[0]:.2f} bits per weight; "
            "raise it, or set it to null for no bound"
        )
    return max(k for k, b in enumerate(bits) if b <= max_bits)


def check_bound(layers: dict[str, tuple[int, int]], args, p: SearchParams) -> None:
    """Raises QuantgateError, before the ranking, when search.max_bits_per_weight leaves the search nothing to
    find: below the base recipe's own bits per weight (top_units), or below the bits with even the smallest
    unit (p.fused) of `layers` kept 16-bit, so every candidate but the base recipe is over it. The message names
    params.yaml's line, the smallest bound that keeps one unit (bits with the fewest weights kept, rounded up
    to 0.01) and what to do. Which unit the ranking puts first is not known yet: a bound above this floor
    may still keep none (search() refuses it after the ranking, naming that unit, with no screen run)."""
    bits = effective_bits(layers, set(), args)
    if p.max_bits_per_weight is None:
        return
    try:
        top_units([bits], p.max_bits_per_weight)
    except QuantgateError as exc:  # its message names no file: the bound's line, as below
        raise QuantgateError(f"{where(PARAMS_FILE, 'search.max_bits_per_weight')}: {exc}") from None
    one = min(effective_bits(layers, set(u), args) for u in units(dict.fromkeys(layers, 0.0), p.fused))
    if one > p.max_bits_per_weight:
        raise QuantgateError(no_unit_within(p, bits, one, "the smallest unit"))


def no_unit_within(p: SearchParams, base: float, one: float, unit: str) -> str:
    """The message for a search.max_bits_per_weight that keeps no unit 16-bit: the base recipe's `base` bits per
    weight and the `one` bits with `unit` (words naming it) kept, both under the bound's params.yaml line, with
    the least bound that keeps it (`one` rounded up to 0.01)."""
    return (
        f"{where(PARAMS_FILE, 'search.max_bits_per_weight')}: search.max_bits_per_weight "
        f"{p.max_bits_per_weight:g} allows no layer kept 16-bit (the base recipe is {base:.2f} bits per weight, "
        f"{unit} kept makes {one:.2f}), so {p.build} could only be {p.base}'s recipe again; raise "
        f"it to at least {math.ceil(round(one * 100, 6)) / 100:.2f}, set it to null, or drop {p.build} from "
        "builds"
    )


def choose(screens: list[Screen]) -> tuple[Screen | None, bool]:
    """(chosen screen, whether it passed): the cheapest passing one (estimated cost per output token where
    the search priced it, else the fewest kept layers), else None: no layer kept, the base recipe (a candidate
    not shown to pass is not a build, and its point estimates are no verdict)."""
    passing = [s for s in screens if s.passed]
    if passing:
        return min(passing, key=lambda s: (s.est_ratio if s.est_ratio is not None else 0.0, s.kept)), True
    return None, False


def subset(scores: TeamScores, keys: set[tuple[str, int]]) -> TeamScores:
    """`scores` with only the samples whose (task, doc_id) is in `keys` (a look's documents)."""
    return scores.model_copy(update={"samples": [x for x in scores.samples if (x.task, x.doc_id) in keys]})


def screen_teams(
    lm,
    teams: list[Team],
    harness: HarnessParams,
    baseline: dict[str, TeamScores],
    gate: GateBlock,
    p: SearchParams,
    budget: Budget,
):
    """Screen the candidate now in `lm` sequentially (quantgate.screening.sequential) against `baseline`
    ({team: 16-bit scores on the first max(p.looks) documents per task}), spending `budget`.
    Returns the ScreenRun."""
    by_name = {t.name: t for t in teams}
    per_task = {t: Counter(x.task for x in b.samples) for t, b in baseline.items()}

    def cost(team: str, limit: int) -> int:
        return sum(min(limit, n) for n in per_task[team].values())

    def judge_at(team: str, limit: int):
        t = by_name[team]
        scores, _ = run_team(lm, t, harness.model_copy(update={"limit": limit}))
        counts = Counter(x.task for x in scores.samples)
        base = subset(baseline[team], {(x.task, x.doc_id) for x in scores.samples})
        policy = t.policy.model_copy(update={"confidence": look_confidence(t.policy.confidence, len(p.looks))})
        c = judge(replace(t, policy=policy), base, scores, gate, p.build)
        return c, len(scores.samples), all(counts[task] < limit for task in per_task[team])

    return sequential([t.name for t in teams], p.looks, judge_at, cost, budget)


def mixed_recipe(base_path: Path, kept: list[str], header: str) -> str:
    """The base recipe's YAML with `kept` appended to the `ignore` of every quantization modifier
    (those with config_groups or a scheme), preceded by `header` as comments."""
    doc = read_yaml(base_path)
    for stage in doc.values():
        for group in stage.values():
            for args in group.values():
                if isinstance(args, dict) and ("config_groups" in args or "scheme" in args):
                    args["ignore"] = list(args.get("ignore") or []) + kept
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(doc, sort_keys=False, width=120)


def hf_lm(model, tokenizer, harness: HarnessParams, max_length: int):
    """lm-eval's in-process hf backend on the in-memory `model`, with the evaluate stage's batch size and
    BOS setting; `max_length` (tokens) is the serving context."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=harness.batch_size,
        add_bos_token=harness.add_bos_token,
        max_length=max_length,
    )


def search(
    model_dir: Path, evals_dir: Path, out_dir: Path, p: SearchParams, price: Pricing | None = None
) -> SearchResult:
    """Run the search (module docstring) and write OUT_DIR/recipe.yaml, search.json and trace.md; `price`
    estimates each candidate's cost (None: by bits per weight).

    Raises QuantgateError for a bad recipe (search.recipe), a group size that does not divide a layer, a
    missing calibration file, or a team whose 16-bit screening run errors."""
    import torch
    from compressed_tensors.utils.match import match_named_modules
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = Path(p.recipe)
    recipe = load_recipe(p.build, base_path, "search.recipe")
    schemes = [(s, ignore) for s, ignore in weight_schemes(recipe) if s.weights is not None]
    if not schemes:
        raise QuantgateError(f"{base_path} (search.recipe): no weight quantization to fall back from")
    scheme, ignore = schemes[0]
    args = scheme.weights
    harness = load_block("evaluate.harness", HarnessParams).model_copy(update={"limit": max(p.looks)})
    max_length = load_block("evaluate.serve", ServeParams).max_model_len
    gate = load_block("gate", GateBlock)
    teams = load_teams(evals_dir)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=None if native_16bit() else torch.float32)
    model.eval()
    if max_length == -1:  # what vLLM could fit at most; the screens run in-process, with no server to ask
        max_length = model_context(model.config.to_dict(), f"{model_dir}/config.json")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    linears = {
        name: m for name, m in match_named_modules(model, scheme.targets, ignore) if isinstance(m, torch.nn.Linear)
    }
    layers = {name: (m.weight.numel(), m.in_features) for name, m in linears.items()}
    if args.strategy == "group":  # before minutes of ranking, as quantize checks it
        check_group_size(model, args.group_size, ignore, f"{base_path} (search.recipe)", scheme.targets)
    check_bound(layers, args, p)  # a bound at or below the base: before ranking
    batches = calibration_ids(tokenizer, CALIBRATION_FILE, p.kl_samples, p.kl_seq_len)

    started = time.monotonic()
    calibration = load_block(f"quantize.{p.build}", QuantizeBlock).calibration or Calibration()
    observed = (
        []
        if args.observer in MIN_MAX
        else calibration_ids(
            tokenizer,
            CALIBRATION_FILE,
            calibration.samples,
            calibration.seq_len,
            f"quantize.{p.build}.calibration.samples",
        )
    )
    quantized = quantized_weights(model, linears, args, observed)
    ranking = sensitivity(model, linears, quantized, batches)
    print(
        f"search: each layer quantized as quantize makes it ({args.observer or 'minmax'} observer"
        + (f", statistics of {len(observed)} conversations" if observed else "")
        + f"), ranked {len(ranking)} layers by KL in {time.monotonic() - started:.0f} s; most sensitive: "
        + ", ".join(f"{n} {kl:.2g}" for n, kl in list(ranking.items())[:3]),
        flush=True,
    )
    ranked = units(ranking, p.fused)
    order = [layer for unit in ranked for layer in unit]  # kept 16-bit from the top, a unit at a time
    bounds = list(itertools.accumulate((len(u) for u in ranked), initial=0))  # layers in the top k units
    lm = hf_lm(model, tokenizer, harness, max_length)
    baseline = {}
    for team in teams:
        scores, _ = run_team(lm, team, harness)
        baseline[team.name] = scores

    originals = {name: m.weight.data.clone() for name, m in linears.items()}

    budget = Budget(p.doc_budget)
    price = price or Pricing(source="no profiles given")
    if price.measured:
        print(f"search: {price_order(price)} ({price.source})", flush=True)

    def screen(k: int) -> Screen | None:
        began, spent = time.monotonic(), budget.spent
        kept = set(order[: bounds[k]])
        with torch.no_grad():
            for name, m in linears.items():
                m.weight.data = originals[name] if name in kept else quantized[name]
        run = screen_teams(lm, teams, harness, baseline, gate, p, budget)
        if budget.spent == spent:  # the budget could not start it
            return None
        s = Screen(
            kept=len(kept),
            outcome=run.outcome.value,
            passed=run.outcome == Outcome.PASS,
            worst_slack=round(min(c.margin - c.upper for c in run.teams.values()), 6),
            teams=run.teams,
            effective_bits=round(effective_bits(layers, kept, args), 3),
            size_mib=round(size_mib(model, layers, kept, args), 1),
            seconds=round(time.monotonic() - began, 1),
            docs=run.docs,
            looks=run.trail,
            est_ratio=rounded(price.ratio(quantized_fraction(layers, kept)), 4),
            layers=order[: bounds[k]],
        )
        print(f"search: keep {len(kept):>3} 16-bit -> {s.outcome} ({'; '.join(run.trail)})", flush=True)
        return s

    bits = [effective_bits(layers, set(order[:b]), args) for b in bounds]
    top = top_units(bits, p.max_bits_per_weight)
    if top == 0:  # check_bound passed: a smaller unit fits, but the ranking puts a larger one first
        raise QuantgateError(no_unit_within(p, bits[0], bits[1], f"the unit ranked first ({'+'.join(ranked[0])})"))
    screens = bisect(len(ranked), screen, top, price.kept_is_cheaper)
    if not screens:
        raise QuantgateError(
            f"search.doc_budget {p.doc_budget}: too small for one look at every team ({p.looks[0]} documents per "
            "task); raise it"
        )
    chosen, passed = choose(screens)
    kept = order[: chosen.kept] if chosen else []
    fraction = quantized_fraction(layers, set(kept))
    with torch.no_grad():
        for name, m in linears.items():
            m.weight.data = originals[name]
    result = SearchResult(
        build=p.build,
        recipe=p.recipe,
        passed=passed,
        chosen=len(kept),
        kept_layers=kept,
        evaluations=len(screens),
        docs_spent=budget.spent,
        doc_budget=p.doc_budget,
        ranked_on=ranked_on(CALIBRATION_FILE, p.kl_samples, p.kl_seq_len),
        effective_bits=round(effective_bits(layers, set(kept), args), 3),
        size_mib=round(size_mib(model, layers, set(kept), args), 1),
        priced_by=price.source,
        kept_is_cheaper=price.kept_is_cheaper,
        est_ratio=rounded(price.ratio(fraction), 4),
        layers=len(order),
        max_bits_per_weight=p.max_bits_per_weight,
        max_kept=None if top is None else bounds[top],
        sensitivity={n: round(v, 6) for n, v in ranking.items()},
        screens=screens,
    )
    header = (
        f"{p.build}: {base_path} with the {len(kept)} most sensitive of its {len(order)} quantized layers kept "
        f"16-bit\n(pipeline.search, {screens_of(len(screens))}, {budget.spent} documents; "
        f"{'passed' if passed else 'NO candidate passed'} "
        f"the screen; see {out_dir / TRACE})"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RECIPE).write_text(mixed_recipe(base_path, kept, header))
    load_recipe(p.build, out_dir / RECIPE)  # llm-compressor reads what quantize will read
    write_search(out_dir / RESULT, result)
    (out_dir / TRACE).write_text(trace(result, p))
    return result


def screens_of(n: int) -> str:
    return f"{n} screen" if n == 1 else f"{n} screens"


def trace(r: SearchResult, p: SearchParams) -> str:
    """The search as markdown: every screen (kept layers, bits, per-team drop vs margin at its last look and
    the interval's verdict, outcome, documents, the looks), then the choice."""
    teams = list(dict.fromkeys(t for s in r.screens for t in s.teams))  # a screen stops at a team's FAIL: the union
    lines = [
        f"# Search trace: {r.build} from {r.recipe}",
        "",
        f"{r.layers} layers ranked by KL on {r.ranked_on}; kept 16-bit a unit at a time (vLLM's fused modules "
        + ", ".join(f"{name} = {'+'.join(members)}" for name, members in p.fused.items())
        + f" as one). Each screen looks at {p.looks} documents per task in turn, judged by the gate's interval at "
        f"each team's confidence split over {len(p.looks)} looks (Bonferroni), until every team is decided; "
        f"{screens_of(r.evaluations)}, {r.docs_spent} of {r.doc_budget} candidate documents (search.doc_budget)."
        + (
            f" A candidate holds at most {r.max_bits_per_weight:g} bits per weight (search.max_bits_per_weight): "
            f"at most {r.max_kept} layers kept 16-bit."
            if r.max_bits_per_weight is not None
            else ""
        ),
        "",
        pricing_line(r),
        "",
        "| kept 16-bit | bits/weight | weights MiB (est.) | cost x 16-bit (est.) | "
        + " | ".join(f"{t} drop / margin (n)" for t in teams)
        + " | screen | docs | looks | s |",
        "|---|---|---|---|" + "---|" * len(teams) + "---|---|---|---|",
    ]
    for s in r.screens:
        looked = {t: f"{c.drop:+.3f} / {c.margin:.3f} ({Verdict(c.verdict).value}, {c.n})" for t, c in s.teams.items()}
        cells = [looked.get(t, "not looked at") for t in teams]
        row = [
            str(s.kept),
            f"{s.effective_bits:.2f}",
            "-" if s.size_mib is None else f"{s.size_mib:.1f}",
            "-" if s.est_ratio is None else f"{s.est_ratio:.2f}x",
            *cells,
            s.outcome,
            str(s.docs),
            "; ".join(s.looks),
            f"{s.seconds:.0f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    verdict = (
        "passed the screen"
        if r.passed
        else "no screened candidate was shown to pass: the base recipe's build, which the gate FAILs"
    )
    cost = "" if r.est_ratio is None else f", about {r.est_ratio:.2f}x the 16-bit build's cost per output token"
    lines += [
        "",
        f"Chosen: {r.chosen} layers kept 16-bit ({verdict}), {r.effective_bits} bits per weight, "
        f"about {r.size_mib} MiB{cost}.",
        "",
        "Kept: " + (", ".join(f"`{n}`" for n in r.kept_layers) or "none"),
        "",
    ]
    return "\n".join(lines)


KEPT_CHEAPER = (
    "the quantized kernel is the slower one here, so a layer kept 16-bit makes a candidate cheaper per token: the "
    "cheapest is the most layers search.max_bits_per_weight allows, the only one screened"
)
KEPT_DEARER = "the quantized kernel is the faster one here: fewer layers kept 16-bit is cheaper, so the bisection"


def price_order(price: Pricing) -> str:
    """What the measured speeds make of the search order, in words (printed when the search starts)."""
    if price.kept_is_cheaper:
        return KEPT_CHEAPER
    if price.kept_is_dearer:
        return KEPT_DEARER
    return (
        f"the two builds' speeds differ by less than search.min_speed_difference ({price.noise:.0%}), so fewer "
        "layers kept 16-bit (smaller) counts as cheaper: the bisection"
    )


def pricing_line(r: SearchResult) -> str:
    """The trace's sentence on how candidates were priced, the order that gives the screens and, where kept
    layers are cheaper, that every candidate still costs more per token than the 16-bit build."""
    if r.est_ratio is None:
        return (
            f"Candidates priced by bits per weight ({r.priced_by or 'no profiles'}): fewer layers kept 16-bit is "
            "smaller, so the search looks for the fewest that pass."
        )
    ratios = [s.est_ratio for s in r.screens if s.est_ratio is not None]
    dearer = (
        f" Every int4-class candidate still costs more per output token than the 16-bit build here (at least "
        f"{min(ratios):.2f}x); what it saves is memory (the weights column)."
        if r.kept_is_cheaper and ratios
        else ""
    )
    order = KEPT_CHEAPER if r.kept_is_cheaper else "fewer layers kept 16-bit is as cheap or cheaper, so the bisection"
    return (
        "Candidates priced relative to the 16-bit build by the cost model (the gate's $ per 1M output tokens is the "
        "device-hour price times seconds per token), each weight's time per token interpolated between the "
        f"measured builds ({r.priced_by}): {order}.{dearer}"
    )


def unservable(p: SearchParams) -> str | None:
    """Why vLLM here cannot serve what this search would make (a W4A16 base recipe on a platform without a
    W4A16 kernel at the run's precision: quantgate.precision.w4a16_problem), or None. Its screens would
    then be minutes spent on a build that fails closed anyway. Raises QuantgateError if the recipe or the
    serving env cannot be read."""
    recipe = load_recipe(p.build, Path(p.recipe), "search.recipe")
    schemes = [s for s, _ in weight_schemes(recipe) if s.weights is not None]
    if not schemes or schemes[0].weights.num_bits != 4 or schemes[0].input_activations is not None:
        return None
    serve = load_block("evaluate.serve", ServeParams)
    platform = probe(serve.python)
    dtype, _ = resolve_dtype(serve.dtype, platform)
    return w4a16_problem(platform, dtype, serve.dtype)


def skip(out_dir: Path, p: SearchParams, builds: list[str], unserved: str | None = None) -> SearchResult:
    """The outs when `p.build` is not a build of this run, or (`unserved`, the reason) when this machine cannot
    serve it: a recipe that says so (for an unserved build, the base recipe with no layer kept 16-bit, which
    quantize@<build> still makes), and the result."""
    why = (
        f"{p.build} is not in params.yaml builds {builds}"
        if unserved is None
        else f"vLLM here cannot serve it: {unserved}"
    )
    result = SearchResult(build=p.build, recipe=p.recipe, skipped=why)
    out_dir.mkdir(parents=True, exist_ok=True)
    if unserved is None:
        (out_dir / RECIPE).write_text(f"# search skipped: {why}; no build reads this file\n")
    else:
        header = f"{p.build}: {p.recipe} with no layer kept 16-bit (search skipped: {why})"
        (out_dir / RECIPE).write_text(mixed_recipe(Path(p.recipe), [], header))
    write_search(out_dir / RESULT, result)
    (out_dir / TRACE).write_text(f"# Search trace\n\nSkipped: {why}.\n")
    return result


def search_task(request: dict) -> dict:
    """Run on a Ray node (executor.kind: ray): the whole search, its ranking and every screen, where the
    build will be served. The task's scratch folder holds params.yaml (its serving python made the node's),
    the recipe, the calibration set and the eval sets, at the paths the stage uses; returns {"node",
    "files": {name: content of OUT_DIR/name}}. Raises QuantgateError (naming the node) as search() does."""
    with on_node(request) as (node, model_dir, _):
        doc = read_yaml(PARAMS_FILE)
        doc["evaluate"]["serve"]["python"] = node_python(doc["evaluate"]["serve"]["python"])
        PARAMS_FILE.write_text(yaml.safe_dump(doc, sort_keys=False))
        p, out_dir = load_block("search", SearchParams), Path(request["out_dir"])
        if unserved := unservable(p):
            skip(out_dir, p, load_builds(), unserved)
        else:
            search(model_dir, Path(request["evals_dir"]), out_dir, p, Pricing(**request["pricing"]))
        return {"node": node, "files": {f.name: f.read_bytes() for f in sorted(out_dir.iterdir())}}


def search_on_ray(
    model_dir: Path,
    evals_dir: Path,
    out_dir: Path,
    p: SearchParams,
    executor: ExecutorParams,
    price: Pricing | None = None,
) -> dict:
    """Run the search as one Ray task on a node with the executor's resources (search_task), write its
    outs to OUT_DIR here and return the node it ran on ({node_id, ip, host}). Raises QuantgateError for a
    cluster that does not answer or lacks the resources (before any work), and with the task's own reason,
    or the node's death, when it fails."""
    connect(executor)
    files = {PARAMS_FILE.as_posix(): PARAMS_FILE.read_bytes(), p.recipe: Path(p.recipe).read_bytes()}
    files[CALIBRATION_FILE.as_posix()] = CALIBRATION_FILE.read_bytes()
    for team in load_teams(evals_dir):
        files |= folder_files(team.path, f"{evals_dir.as_posix()}/{team.name}")
    request = {**published(model_dir, executor), "files": files, "evals_dir": str(evals_dir), "out_dir": str(out_dir)}
    request["pricing"] = (price or Pricing(source="no profiles given")).model_dump()  # priced here
    ((reply, why),) = settle([submit(search_task, request, executor)], executor)
    if reply is None:
        raise QuantgateError(f"search on Ray: {why}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in reply["files"].items():
        (out_dir / name).write_bytes(data)
    print(f"search: ran on Ray node {reply['node']['ip']} ({reply['node']['node_id'][:12]})", flush=True)
    return reply["node"]


def main() -> None:
    if len(sys.argv) != 5:
        raise QuantgateError("usage: python -m pipeline.search MODEL_DIR EVALS_DIR OUT_DIR PROFILE_DIR")
    model_dir, evals_dir, out_dir, profile_dir = map(Path, sys.argv[1:])
    p = load_block("search", SearchParams)
    builds = load_builds()
    if p.build not in builds:
        r = skip(out_dir, p, builds)
        print(f"search: skipped ({r.skipped})")
        return
    price = pricing(profile_dir, p, builds)
    if (executor := load_block("executor", ExecutorParams)).kind == "ray":
        search_on_ray(model_dir, evals_dir, out_dir, p, executor, price)
        r = read_search(out_dir / RESULT)
        if r.skipped:
            print(f"search: skipped, no screens ({r.skipped})")
            return
    elif unserved := unservable(p):
        r = skip(out_dir, p, builds, unserved)
        print(f"search: skipped, no screens ({r.skipped})")
        return
    else:
        r = search(model_dir, evals_dir, out_dir, p, price)
    outcome = (
        "passed the screen"
        if r.passed
        else "NO candidate passed the screen, so it is the base recipe's build (the gate will FAIL it)"
    )
    print(
        f"search: {r.build} keeps {r.chosen} of {r.layers} layers 16-bit, {outcome}; {r.effective_bits} bits/weight, "
        f"~{r.size_mib} MiB"
        + ("" if r.est_ratio is None else f", ~{r.est_ratio:.2f}x the 16-bit build's cost per token")
        + f"; {screens_of(r.evaluations)}, {r.docs_spent} of {r.doc_budget} documents; "
        f"wrote {out_dir / RECIPE}"
    )


if __name__ == "__main__":
    run_main(main, log="search")
