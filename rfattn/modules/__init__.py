"""nn.Modules, one file per family (DESIGN §1): :mod:`.features` (RandomFeatures, PPSBN)."""

from rfattn.modules.features import PPSBN, RandomFeatures, ppSBN

__all__ = ["RandomFeatures", "PPSBN", "ppSBN"]
