"""nn.Modules, one file per family (docs/design.md): :mod:`.features` (RandomFeatures, PPSBN),
:mod:`.flt` (FourierRPE) and :mod:`.attention` (RFAttention, RFMultiheadAttention)."""

from rfattn.modules.attention import RFAttention, RFMultiheadAttention, layer_seed
from rfattn.modules.features import PPSBN, RandomFeatures, ppSBN
from rfattn.modules.flt import FourierRPE

__all__ = [
    "RandomFeatures",
    "PPSBN",
    "ppSBN",
    "FourierRPE",
    "RFAttention",
    "RFMultiheadAttention",
    "layer_seed",
]
