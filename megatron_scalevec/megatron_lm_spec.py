"""The module Megatron-LM's ``--spec`` names; importing it installs our hooks (on purpose):

    python pretrain_gpt.py --spec megatron_scalevec.megatron_lm_spec scalevec_moe ...

``scalevec_dense`` / ``scalevec_moe``: lazy ``TransformerBlock`` specs (sized from Megatron-LM's
parsed args when the model is built) of the unified strategy, or of the one the environment
names (``MEGATRON_SCALEVEC``, ``MEGATRON_SCALEVEC_VECTOR_WD``; read here, at import).

Inside Megatron-LM (``megatron.training`` already imported, as ``pretrain_gpt.py`` has done
before it reads ``--spec``) the import installs :mod:`megatron_scalevec.megatron_lm`'s wrappers:
IWD, the decay summary, scale-vector statistics, the code-free checkpoint-metadata loader. This
is the package's only module with an effect on import; ``megatron_scalevec.specs`` has none.
"""

import sys

from megatron_scalevec import megatron_lm

scalevec_dense, scalevec_moe = megatron_lm.spec_objects()

if "megatron.training" in sys.modules:  # imported by Megatron-LM's --spec
    megatron_lm.install_block_hook()  # each model chunk's layers for its own stage
    megatron_lm.install()
    megatron_lm.refuse_unsupported_args()  # before Megatron-LM builds the model
