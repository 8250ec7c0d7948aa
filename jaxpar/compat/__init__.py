"""What combines: the one compatibility table (``table``), its rules of pairs (``settings``) and of one
feature (``needs``), and its Markdown."""
from jaxpar.compat._table import (ALTERNATIVES as ALTERNATIVES, CODES as CODES, FEATURES as FEATURES,
                                  LIBRARY_NAMES as LIBRARY_NAMES, PARTLY as PARTLY, REFUSED as REFUSED,
                                  Feature as Feature, Problem as Problem, Setting as Setting, all_pairs as all_pairs,
                                  needs as needs, pair_status as pair_status, problems as problems,
                                  raise_problems as raise_problems)

__all__ = ["Feature", "FEATURES", "CODES", "Setting", "Problem", "problems", "needs", "raise_problems",
           "pair_status", "REFUSED", "PARTLY", "ALTERNATIVES", "LIBRARY_NAMES", "all_pairs"]
