"""Tree-structured energy datasets: the common model and one loader per source."""

from vllm_piep.datasets.model import (
    BadRows,
    DatasetError,
    IssueLog,
    Level,
    RowIssue,
    TreeDataset,
    concat,
)

__all__ = ["BadRows", "DatasetError", "IssueLog", "Level", "RowIssue", "TreeDataset", "concat"]
