"""ScaleVecConfig: the one object that says which scale-vector strategy a model uses.

The strategy is a small set of independent switches (see SPEC.md):

==========  =================================================================
``none``    every scale vector removed (fixed to 1), the final norm's too
``shared``  baseline: one gamma per Pre-Norm, as in Llama (default base)
``hg``      branch heterogeneity: one input vector per projection branch
``dp``      double-sided placement: an output-side vector after each branch
``dnp``     double-sided normalized placement: a norm, then the output vector
``or``      magnitude-direction in the original space (beta * sqrt(m) u/|u|)
``er``      magnitude-direction in exponential space (exp(alpha + v - mean v))
``iwd``     individualized weight decay (Input-Norm decays, Output-Norm not)
``unified`` hg + dnp + or + iwd, the paper's recommended strategy
==========  =================================================================

``or`` and ``er`` are parameterizations: every registered parameterization's name is a token
(parameterizations.py; ``plain``, the stock one, is the default and has none). Readings the
paper leaves open are fields here, never constants in the layers.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

PRESETS = {
    "baseline": "shared",
    "shared": "shared",
    "none": "none",
    "unified": "hg+dnp+or+iwd",
}
EXPERT_VECTORS = ("per_expert", "shared")
LAYERNORM_BIAS = ("stock", "none")
SWITCHES = ("shared", "none", "hg", "dp", "dnp", "iwd")


def _registry():
    """parameterizations.py, imported on use: this module imports no torch of its own."""
    from megatron_scalevec import parameterizations  # noqa: PLC0415

    return parameterizations


def strategy_tokens() -> tuple:
    """The strategy string's tokens: the switches and every registered parameterization but
    the stock one (the default)."""
    reg = _registry()
    return (*SWITCHES, *(n for n in reg.names() if not reg.get(n).stock))


@dataclass(frozen=True)
class ScaleVecConfig:
    """Which scale-vector variants are on, plus the configurable readings.

    Attributes:
        vectors: False for the ``none`` ablation (no learnable scale anywhere).
        hg: per-branch input vectors (q, k, v, gate, up, router, per expert).
        dp: output-side vector after each branch projection (foldable).
        dnp: per-branch normalization, then an output-side vector (QK-norm style).
        parameterization: a registered parameterization for every vector (``plain``, ``or``,
            ``er``: parameterizations.py).
        iwd: individualized weight decay by role.
        scale_vector_weight_decay: decay for Input-Norm vectors; None = the matrices' value
            (and schedule); a value scales with the matrices' schedule (optim.py).
        dp_output_role: IWD role of DP's output vector (reading: ``input``, it is absorbable).
        decay_direction: under IWD also decay the parts a parameterization leaves undecayed
            (OR's direction, ER's logit; reading: False).
        apply_mode: how vectors meet a linear layer: ``weight`` folds them into the
            effective weight (one GEMM), ``activation`` scales activations (works with
            any linear implementation, e.g. Transformer Engine), ``auto`` picks weight
            for megatron-core's local linears and activation otherwise.
        expert_vectors: MoE reading of the expert-side vectors (HG input, DP / DNP output):
            ``per_expert`` (SPEC.md: every routed expert has its own) or ``shared`` (one set
            per MoE layer used by all its routed experts; about E times fewer parameters for
            fine-grained MoE). Shared experts and the router are unaffected.
        layernorm_bias: where a LayerNorm's bias goes (``normalization='LayerNorm'``; SPEC.md
            is written for RMSNorm, which has none; reading). ``stock``: every norm
            megatron-core's own layer has (the Pre-Norms, the MoE pre-norm, the final norm,
            ``qk_layernorm``'s QK-norm) keeps its bias beta, added after the norm's own vector:
            ``gamma * N(x) + beta``, which is megatron-core's LayerNorm under ``shared``; under
            HG, whose vectors sit in the branches, ``q = W_q(gamma_q * (N(x) + beta))``, which
            folds exactly into a stock layer (gamma_q into W_q, beta kept) and is what
            Transformer Engine's fused LayerNorm + linear computes with a folded weight. DNP's
            added norms have none. ``none``: no bias anywhere.
        vector_lr_mult: the scale vectors' learning rate over the base one (every vector
            part; the schedule's peak and floor both scaled, optim.py). None: the strategy's
            default (:func:`default_vector_lr_mult`), resolved at construction so a recorded
            config never changes meaning.
    """

    vectors: bool = True
    hg: bool = False
    dp: bool = False
    dnp: bool = False
    parameterization: str = "plain"
    iwd: bool = False
    scale_vector_weight_decay: Optional[float] = None
    dp_output_role: str = "input"
    decay_direction: bool = False
    apply_mode: str = "auto"
    expert_vectors: str = "per_expert"
    layernorm_bias: str = "stock"
    vector_lr_mult: Optional[float] = None

    def __post_init__(self):
        if self.dp and self.dnp:
            raise ValueError("ScaleVecConfig: 'dp' and 'dnp' conflict: both place an output-side "
                             "vector on the same branch; choose one")
        known = _registry().names()
        if self.parameterization not in known:
            raise ValueError(f"ScaleVecConfig.parameterization must be one of "
                             f"{', '.join(known)}; got {self.parameterization!r}")
        if not self.vectors and (self.hg or self.dp or self.dnp or self.iwd
                                 or not self.stock_gamma):
            raise ValueError("ScaleVecConfig: 'none' removes every scale vector and cannot be "
                             f"combined with other variants (got {self.to_string()!r})")
        if self.dp_output_role not in ("input", "output"):
            raise ValueError("ScaleVecConfig.dp_output_role must be 'input' or 'output'")
        if self.apply_mode not in ("auto", "weight", "activation"):
            raise ValueError("ScaleVecConfig.apply_mode must be auto, weight or activation")
        if self.expert_vectors not in EXPERT_VECTORS:
            raise ValueError(f"ScaleVecConfig.expert_vectors must be one of {EXPERT_VECTORS} "
                             f"(one set of MoE expert vectors per expert, or one per layer "
                             f"shared by its routed experts); got {self.expert_vectors!r}")
        if self.layernorm_bias not in LAYERNORM_BIAS:
            raise ValueError(f"ScaleVecConfig.layernorm_bias must be one of {LAYERNORM_BIAS}; "
                             f"got {self.layernorm_bias!r}")
        if self.scale_vector_weight_decay is not None and self.scale_vector_weight_decay < 0:
            raise ValueError("ScaleVecConfig.scale_vector_weight_decay must be >= 0")
        if self.vector_lr_mult is None:  # after the checks: the default reads the strategy
            object.__setattr__(self, "vector_lr_mult", default_vector_lr_mult(self))
        m = self.vector_lr_mult
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) \
                or m <= 0:
            raise ValueError(f"ScaleVecConfig.vector_lr_mult must be a number > 0 (the scale "
                             f"vectors' learning rate over the base one); got {m!r}")
        object.__setattr__(self, "vector_lr_mult", float(m))

    @classmethod
    def from_string(cls, text: str, **overrides) -> ScaleVecConfig:
        """Parse ``"unified"``, ``"shared"``, ``"none"``, ``"hg+dnp+or+iwd"``, ``"hg+dp+er"``."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("ScaleVecConfig.from_string: empty strategy string")
        known, tokens = strategy_tokens(), []
        for raw in text.lower().replace(",", "+").split("+"):
            tok = raw.strip()
            if tok in PRESETS:
                tokens.extend(PRESETS[tok].split("+"))
            elif tok in known:
                tokens.append(tok)
            else:
                names = ", ".join(sorted(set(known) | set(PRESETS)))
                raise ValueError(f"unknown scale-vector variant {tok!r} in {text!r}; "
                                 f"known: {names}")
        if "none" in tokens and len(set(tokens)) > 1:
            raise ValueError(f"'none' removes every scale vector and conflicts with "
                             f"{sorted(set(tokens) - {'none'})} in {text!r}")
        if "shared" in tokens and "hg" in tokens:
            raise ValueError(f"'shared' (one gamma per norm) conflicts with 'hg' "
                             f"(one gamma per branch) in {text!r}")
        params = [t for t in dict.fromkeys(tokens) if t not in SWITCHES]
        if len(params) > 1:
            raise ValueError(f"{' and '.join(map(repr, params))} conflict in {text!r}: a vector "
                             f"has one parameterization")
        if "dp" in tokens and "dnp" in tokens:
            raise ValueError(f"'dp' and 'dnp' conflict in {text!r}: both place an output-side "
                             f"vector on the same branch; choose one")
        param = params[0] if params else _registry().stock_name()
        fields = dict(vectors="none" not in tokens, hg="hg" in tokens, dp="dp" in tokens,
                      dnp="dnp" in tokens, parameterization=param, iwd="iwd" in tokens)
        fields.update(overrides)
        return cls(**fields)

    def to_string(self) -> str:
        """Canonical name, e.g. ``hg+dnp+or+iwd``; round-trips through from_string."""
        if not self.vectors:
            return "none"
        parts = ["hg" if self.hg else "shared"]
        parts += [p for p, on in (("dp", self.dp), ("dnp", self.dnp)) if on]
        if not self.stock_gamma:
            parts.append(self.parameterization)
        if self.iwd:
            parts.append("iwd")
        return "+".join(parts)

    def replace(self, **changes) -> ScaleVecConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field (plain data): what a checkpoint records of the strategy."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ScaleVecConfig:
        """A recorded config; one recorded before ``vector_lr_mult`` existed trained its
        vectors at the base LR (1.0), whatever today's default."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ScaleVecConfig: unknown fields {unknown}")
        return cls(**{"vector_lr_mult": 1.0, **d})

    def describe(self) -> str:
        """The strategy string and every option that differs from its default, in one line
        (``hg+dp+er (scale_vector_weight_decay=0.05, expert_vectors='shared')``)."""
        base = ScaleVecConfig.from_string(self.to_string())
        extra = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(base, f.name)]
        return self.to_string() + (f" ({', '.join(extra)})" if extra else "")

    @property
    def is_baseline(self) -> bool:
        """True when the model is computed exactly as megatron-core's stock layers."""
        return self.vectors and not (self.hg or self.dp or self.dnp) and self.stock_gamma

    @property
    def stock_gamma(self) -> bool:
        """True when every vector stores gamma as is, megatron-core's own norm weight (the
        stock parameterization, ``plain``)."""
        return _registry().get(self.parameterization).stock

    def resolve_apply_mode(self, local_linear: bool) -> str:
        if self.apply_mode != "auto":
            return self.apply_mode
        return "weight" if local_linear else "activation"


# The vectors' LR multiplier measured best, or within 0.02 of it, for `unified` at every width
# and depth swept (docs/RESULTS.md, "Headline").
RECOMMENDED_VECTOR_LR_MULT = 30.0


def default_vector_lr_mult(cfg: ScaleVecConfig) -> float:
    """The vectors' LR multiplier a strategy gets unless one is given: x30 for every strategy
    that changes the model (docs/RESULTS.md); 1 for ``shared`` (stock megatron-core, LR
    included, unless asked) and ``none`` (no vectors)."""
    return 1.0 if cfg.is_baseline or not cfg.vectors else RECOMMENDED_VECTOR_LR_MULT


def moe_layer_flags(num_layers: int, moe_layer_freq, is_moe: bool) -> list:
    """0/1 per layer: which layers are MoE under megatron-core's ``moe_layer_freq`` (every
    k-th layer from layer 0, or an explicit 0/1 list); the spec and the converter share it."""
    if not is_moe:
        return [0] * num_layers
    if isinstance(moe_layer_freq, int):
        return [1 if i % moe_layer_freq == 0 else 0 for i in range(num_layers)]
    if len(moe_layer_freq) != num_layers:
        raise ValueError(f"moe_layer_freq has {len(moe_layer_freq)} entries for {num_layers} "
                         f"layers")
    return [int(m) for m in moe_layer_freq]


# Features the scale-vector specs do not support yet: (Megatron-LM flag, set on these options?,
# why). The options are Megatron-LM's args or a TransformerConfig (the same names): Megatron-LM
# refuses them when it imports our --spec module (megatron_lm.py), every entry point (our
# trainer, Megatron-LM, Megatron-Bridge's providers) when the block spec is built, before any
# model exists (specs.get_scalevec_block_spec).
_UNTESTED = "untested with the scale vectors"
UNSUPPORTED = [
    ("--use-megatron-fsdp", lambda a: getattr(a, "use_megatron_fsdp", False),
     "Megatron-FSDP's sharded parameters are untested with the vectors' reads and folds; use "
     "the distributed optimizer"),
    ("--use-custom-fsdp", lambda a: getattr(a, "use_custom_fsdp", False),
     "Megatron-FSDP (see --use-megatron-fsdp)"),
    ("--use-torch-fsdp2", lambda a: getattr(a, "use_torch_fsdp2", False),
     "torch FSDP2 shards the weights the fold reads whole; use the distributed optimizer"),
    ("--enable-cuda-graph / --external-cuda-graph / --cuda-graph-impl",
     lambda a: (getattr(a, "enable_cuda_graph", False) or getattr(a, "external_cuda_graph", False)
                or getattr(a, "cuda_graph_impl", "none") not in (None, "none")),
     f"CUDA graphs are {_UNTESTED} (their once-per-step state and the folded weights' release "
     f"live outside a graph)"),
    ("--tp-comm-overlap", lambda a: getattr(a, "tp_comm_overlap", False),
     f"TE's userbuffer overlap of the TP communication is {_UNTESTED}' folded TE linears"),
    ("--context-parallel-size > 1", lambda a: (getattr(a, "context_parallel_size", 1) or 1) > 1,
     f"context parallelism is {_UNTESTED}' gradient reductions"),
    ("--fp4-format", lambda a: bool(getattr(a, "fp4", None)),
     f"NVFP4 training is {_UNTESTED} folded into TE's weights"),
    ("--mtp-num-layers", lambda a: bool(getattr(a, "mtp_num_layers", None)),
     f"multi-token prediction is {_UNTESTED} (Megatron-LM builds its MTP layers from "
     f"megatron-core's own spec)"),
    *((f"--fp8-recipe {recipe}", lambda a, recipe=recipe: bool(getattr(a, "fp8", None)) and
       getattr(a, "fp8_recipe", None) == recipe,
       f"{what} is {_UNTESTED} folded into TE's weights (the delayed and tensorwise recipes "
       f"are tested and not refused)")
      for recipe, what in (("mxfp8", "MXFP8"), ("blockwise", "FP8 block scaling"),
                           ("custom", "a custom FP8 recipe"))),
]


def unsupported_feature(options) -> Optional[str]:
    """The first unsupported feature set on ``options``, as one line naming its flag, or None."""
    for flag, is_set, why in UNSUPPORTED:
        if is_set(options):
            return f"{flag} is not supported: {why}"
    return None


def unsupported_with(options, scalevec: ScaleVecConfig) -> Optional[str]:
    """A flag on ``options`` (Megatron-LM's args or a TransformerConfig) that this strategy
    cannot honour, as one line naming it, or None."""
    zero_centered = (getattr(options, "layernorm_zero_centered_gamma", False)
                     or getattr(options, "apply_layernorm_1p", False))
    local = getattr(options, "transformer_impl", "local") == "local"
    ours_plain = scalevec.vectors and scalevec.stock_gamma and (
        local or scalevec.hg or scalevec.dp or scalevec.dnp
        or getattr(options, "qk_layernorm", False))
    if zero_centered and ours_plain:
        return ("--apply-layernorm-1p (zero-centred gamma, stored as gamma - 1) is not "
                f"supported for {scalevec.to_string()}'s plain vectors in our norms and "
                f"linears: use another parameterization ({_others()}), or shared on "
                "--transformer-impl transformer_engine without --qk-layernorm (TE's norms)")
    if zero_centered and scalevec.iwd and scalevec.stock_gamma:
        # TE's own norm weight, stored as gamma - 1: IWD's decay would pull gamma toward 1, not
        # 0 (another parameterization decays its own parts, which zero-centring does not touch)
        return ("--apply-layernorm-1p (zero-centred gamma, stored as gamma - 1) is not "
                "supported with IWD on plain vectors: its decay would pull gamma toward 1, "
                f"not 0; use another parameterization ({_others()}), or drop iwd or the flag")
    if getattr(options, "apply_wd_to_qk_layernorm", False) and (scalevec.dnp or scalevec.iwd):
        return (f"--apply-wd-to-qk-layernorm is not supported with {scalevec.to_string()}: "
                f"{'DNP' if scalevec.dnp else 'IWD'} decides the QK-norm's decay (an "
                f"Output-Norm vector: none); drop the flag")
    return None


def _others() -> str:
    """The registered parameterizations other than the stock one, upper-cased for messages."""
    reg = _registry()
    return " or ".join(n.upper() for n in reg.names() if not reg.get(n).stock)
