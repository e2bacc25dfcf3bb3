"""`infemeral.audit`: measure what a pod operator could learn from your own prompt.

    from infemeral.audit import audit
    report = audit("My SSN is 078-05-1120", "bundles/client")
    print(report.text())

Every attack runs on exactly what the server would receive (see observed.py) and on
nothing the server would not have: norm matching (norm_matching.py), Gram linking
(gram_linking.py), vocabulary matching after solving Q (procrustes.py,
vocabulary_matching.py) and inversion of the first served layer's keys and values
(kv_inversion.py). docs/design.md §3 has the measurements these reproduce.
"""

from __future__ import annotations

from infemeral.audit.report import AuditReport, Row
from infemeral.audit.run import audit
from infemeral.audit.samples import DEFAULT_PROMPT

__all__ = ["AuditReport", "DEFAULT_PROMPT", "Row", "audit"]
