"""Query: the engine that answers "which training examples most influenced this output"."""

from gradindex.query.engine import Hit, QueryEngine, QueryResult
from gradindex.query.full import full_gradient_scores
from gradindex.query.inputs import as_record, as_records, read_queries, tokenize_queries
from gradindex.query.search import Ranked, rerank

__all__ = ["Hit", "QueryEngine", "QueryResult", "Ranked", "as_record", "as_records", "full_gradient_scores",
           "read_queries", "rerank", "tokenize_queries"]
