"""What combines: the one compatibility table (``table``), its rules of pairs (``settings``) and of one
feature (``needs``), and its Markdown."""
from jaxpar.compat._table import (ALTERNATIVES as ALTERNATIVES, CODES as CODES, FEATURES as FEATURES,
                                  LIBRARY_NAMES as LIBRARY_NAMES, PARTLY as PARTLY, REFUSED as REFUSED,
                                  Feature as Feature, Problem as Problem, Setting as Setting, all_pairs as all_pairs,
                                  codec_problems as codec_problems, needs as needs, pair_status as pair_status,
                                  problems as problems, raise_first as raise_first, raise_problems as raise_problems,
                                  raise_strategy_problems as raise_strategy_problems)

__all__ = ["Feature", "FEATURES", "CODES", "Setting", "Problem", "problems", "needs", "raise_problems",
           "raise_first", "raise_strategy_problems", "codec_problems", "pair_status", "REFUSED", "PARTLY",
           "ALTERNATIVES", "LIBRARY_NAMES", "all_pairs"]
