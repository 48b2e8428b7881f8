"""The module Megatron-LM's ``--spec`` names; importing it installs our hooks (on purpose):

    python pretrain_gpt.py --spec megatron_scalevec.megatron_lm_spec scalevec_moe ...

``scalevec_dense`` / ``scalevec_moe``: lazy ``TransformerBlock`` specs (sized for each model
chunk's config and pipeline stage when it is built) of the unified strategy, or of the one the
environment names (``MEGATRON_SCALEVEC`` and its option variables,
:mod:`megatron_scalevec.megatron_lm_strategy`; read here, at import).

Inside Megatron-LM (``megatron.training`` already imported, as ``pretrain_gpt.py`` has done
before it reads ``--spec``) the import installs :mod:`megatron_scalevec.megatron_lm`'s hooks
(the block sized per stage, IWD, the decay summary, scale-vector statistics, the strategy check
on resume, the code-free checkpoint-metadata loader), refuses flags the strategy cannot honour,
checks that every rank read the same strategy and records it in Megatron-LM's ``args`` (so in
every checkpoint). This is the package's only module with an effect on import;
``megatron_scalevec.specs`` has none.
"""

import sys

from megatron_scalevec import megatron_lm

try:
    scalevec_dense, scalevec_moe = megatron_lm.spec_objects()
except ValueError as e:  # a strategy variable that does not parse
    if "megatron.training" in sys.modules:
        megatron_lm.refuse(str(e))  # one line, exit 2, on every rank
    raise

if "megatron.training" in sys.modules:  # imported by Megatron-LM's --spec
    megatron_lm.install_block_hook()  # each model chunk's layers for its own stage
    megatron_lm.install()
    megatron_lm.start(scalevec_moe.submodules.scalevec)  # refusals, ranks agree, args record
