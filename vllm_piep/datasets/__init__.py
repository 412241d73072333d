"""Tree-structured energy datasets: the common model and one loader per source."""

from vllm_piep.datasets.model import (
    LEVELS,
    BadRows,
    DatasetError,
    IssueLog,
    Level,
    RowIssue,
    TreeDataset,
)

__all__ = ["BadRows", "DatasetError", "IssueLog", "LEVELS", "Level", "RowIssue", "TreeDataset"]
