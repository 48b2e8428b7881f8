"""megatron-core 0.16.1 through 0.19.x: every API difference we depend on, detected by feature.

Nothing here compares version numbers: each helper looks for the attribute, module or keyword
that moved and picks the matching call, so a later patch release that keeps an API keeps
working. The rest of the package calls these helpers and never branches on the version.

==  =====================================  ===================================================
#   what moved                             how it is detected
==  =====================================  ===================================================
1   0.17: the results queue of the sync    ``filesystem_async.get_write_results_queue``
    dist-ckpt writer is                    (mp_mode) present, else the private
    ``get_write_results_queue(mp_mode)``   ``_get_write_results_queue()``
2   0.17: ``TorchDistSaveShardedStrategy`` we wrap ``TorchDistSaveShardedStrategy.save``
    has its own ``save()`` (a wrapper of   itself, which is the inherited method on 0.16
    ``AsyncSaveShardedStrategy.save`` no
    longer runs); 0.19: ``strategies/
    base.py`` is gone
3   0.17: the common-state strategy is     ``strategies.common.TorchCommonLoadStrategy``
    gone (``common_strategy`` must be      importable: pass one that reads nothing; else the
    None); 0.19: the common state lives    module-level reader(s) of ``serialization`` are
    inside the torch_dist files            stubbed for the duration of the load
4   0.17: the router is built with        ``accepted_kwargs(cls, ...)`` keeps only the
    ``is_mtp_layer=``; 0.18: ``MLP`` gets  keywords the class's ``__init__`` names; our
    ``config=, pg_collection=,             subclasses take the new keywords and pass on what
    is_mtp_layer=, name=`` (through        their base accepts
    ``MLP.as_mlp_submodule``), experts /
    shared experts / ``MoELayer`` get
    ``name=``
5   0.18: with ``qk_layernorm``            no detection needed: layers/attention.py fills the
    ``SelfAttention`` needs a norm class   stock q/k slots with ``IdentityOp`` (valid on every
    in the spec                            release) and applies its own norms
6   0.17: ``grouped_gemm_util`` removed    not used any more (our grouped experts use
                                           torch's grouped_mm, layers/grouped.py)
7   0.19: ``GPTModel`` logs a deprecation  ``quiet_known_notices()``: dropped
    notice on every construction
8   0.18: Muon is built by                 ``get_muon_optimizer``: megatron's
    ``get_megatron_optimizer`` from        ``_get_megatron_emerging_optimizer`` present, else
    ``optimizer='muon'``; the old getter   ``optimizer.muon.get_megatron_muon_optimizer``
    is a shim that keeps the optimizer
    name (so it would build Adam)
==  =====================================  ===================================================
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

__all__ = [
    "accepted_kwargs",
    "get_results_queue_factory",
    "load_tensors_only",
    "patch_results_queue",
    "quiet_known_notices",
    "sync_save_strategy_class",
]


# --- dist checkpointing (1-3) -----------------------------------------------------------------

_QUEUE_NAMES = ("get_write_results_queue", "_get_write_results_queue")


def _queue_attr(module) -> str:
    for name in _QUEUE_NAMES:
        if hasattr(module, name):
            return name
    raise ImportError("megatron-core's filesystem_async has no write-results-queue factory "
                      f"(looked for {', '.join(_QUEUE_NAMES)})")


def get_results_queue_factory():
    """The (module, attribute name) of the dist-ckpt writer's results-queue factory."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async, _queue_attr(filesystem_async)


def patch_results_queue(make_replacement) -> None:
    """Replace the results-queue factory by ``make_replacement(orig)`` (any signature)."""
    module, name = get_results_queue_factory()
    setattr(module, name, make_replacement(getattr(module, name)))


def sync_save_strategy_class():
    """The class whose ``save()`` runs a synchronous torch_dist save (item 2)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy


def _legacy_common_strategy():
    try:
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    except ImportError:
        return None

    class TensorsOnly(TorchCommonLoadStrategy):
        """Never reads ``common.pt`` (Megatron-LM pickles its args there): tensors only."""

        def load_common(self, checkpoint_dir):
            return {}

        def load_sharded_metadata(self, checkpoint_dir):
            return {}

    return TensorsOnly()


_COMMON_READERS = ("load_common", "load_common_state_dict")


@contextlib.contextmanager
def _no_common_state():
    from megatron.core.dist_checkpointing import serialization

    saved = {n: getattr(serialization, n) for n in _COMMON_READERS if hasattr(serialization, n)}
    for name in saved:
        setattr(serialization, name, lambda *args, **kwargs: {})
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(serialization, name, fn)


def load_tensors_only(sharded_state_dict, checkpoint_dir, sharded_strategy=None):
    """``dist_checkpointing.load`` of the tensors in ``sharded_state_dict`` that never reads the
    checkpoint's common (pickled, non-tensor) state, on every supported megatron-core."""
    from megatron.core import dist_checkpointing

    common = _legacy_common_strategy()
    if common is not None:
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                       sharded_strategy=sharded_strategy,
                                       common_strategy=common)
    with _no_common_state():
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                       sharded_strategy=sharded_strategy)


# --- layers (4-7) -----------------------------------------------------------------------------

@functools.cache
def _init_params(cls) -> frozenset:
    return frozenset(inspect.signature(cls.__init__).parameters)


def accepted_kwargs(cls, **kwargs) -> dict:
    """The subset of ``kwargs`` that ``cls.__init__`` names: keywords added in later releases
    (``name=``, ``is_mtp_layer=``) are dropped where the class does not take them yet."""
    names = _init_params(cls)
    return {k: v for k, v in kwargs.items() if k in names}


# --- log notices (8) --------------------------------------------------------------------------

class _DropRepeats(logging.Filter):
    """Passes the first record that starts with ``prefix``, drops the later ones."""

    def __init__(self, prefix: str, keep_first: bool):
        super().__init__()
        self.prefix, self.seen = prefix, not keep_first

    def filter(self, record):
        if not record.getMessage().startswith(self.prefix):
            return True
        seen, self.seen = self.seen, True
        return not seen


_NOTICES = (
    # 0.19: every GPTModel construction warns that GPTModel is deprecated (HybridModel does not
    # exist on 0.16, and Megatron-LM's own pretrain_gpt.py builds GPTModel): not shown, it
    # would be the first line of every run and of every one-line refusal.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED", False),
    # TransformerLayer (<= 0.17) warns "Unknown MLP type" for any MLP class it does not list by
    # identity (ours included), then builds it correctly with default kwargs.
    ("megatron.core.transformer.transformer_layer", "Unknown MLP type", False),
    # 0.19: a dist-checkpointing save advises NVRx's async saving, also for a synchronous save
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated",
     False),
)
_QUIETED: set = set()


def quiet_known_notices() -> None:
    """Install the filters for the notices above once (idempotent)."""
    for logger_name, prefix, keep_first in _NOTICES:
        if (logger_name, prefix) not in _QUIETED:
            logging.getLogger(logger_name).addFilter(_DropRepeats(prefix, keep_first))
            _QUIETED.add((logger_name, prefix))


# --- Muon (9) ---------------------------------------------------------------------------------

def get_muon_optimizer(config, model_chunks, config_overrides):
    """Muon on megatron-core's optimizer: ``optimizer.muon.get_megatron_muon_optimizer`` up to
    0.17; from 0.18 ``get_megatron_optimizer`` builds it from ``config.optimizer='muon'`` (the
    old name survives only as a shim that keeps ``config.optimizer``, i.e. would build Adam)."""
    import importlib.util

    from megatron.core import optimizer as mopt

    if importlib.util.find_spec("emerging_optimizers") is None:
        raise RuntimeError("--optimizer muon needs the emerging-optimizers package "
                           "(pip install 'emerging-optimizers==0.3.0'; Python >= 3.12)")
    if hasattr(mopt, "_get_megatron_emerging_optimizer"):
        config.optimizer = "muon"
        return mopt.get_megatron_optimizer(config, model_chunks,
                                           config_overrides=config_overrides)
    from megatron.core.optimizer.muon import get_megatron_muon_optimizer

    return get_megatron_muon_optimizer(config, model_chunks, config_overrides=config_overrides)
