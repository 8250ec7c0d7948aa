"""What combines: the one compatibility table (``table``), its rules of pairs (``settings``) and of one
feature (``needs``), and its Markdown."""
from jaxpar.compat._table import (ALTERNATIVES, CODES, FEATURES, LIBRARY_NAMES, PARTLY, REFUSED, Feature, Problem,
                                  Setting, all_pairs, codec_problems, needs, pair_status, problems, raise_first,
                                  raise_problems, raise_strategy_problems)

__all__ = ["Feature", "FEATURES", "CODES", "Setting", "Problem", "problems", "needs", "raise_problems",
           "raise_first", "raise_strategy_problems", "codec_problems", "pair_status", "REFUSED", "PARTLY",
           "ALTERNATIVES", "LIBRARY_NAMES", "all_pairs"]
