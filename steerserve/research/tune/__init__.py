"""``steerserve tune``: one resumable pipeline from a model to a confirmed, per-language-gated
artifact: extract -> calibrate -> confirm -> gate -> test -> publish (``stages.py``), the gate
rule written once (``gate.py``), the settings checked before compute (``config.py``), the test
stage (``testing.py``) and the report beside the artifact (``report.py``).
"""

from steerserve.research.tune.config import STAGES, TuneConfig
from steerserve.research.tune.gate import RULE, GateSettings
from steerserve.research.tune.pipeline import run

__all__ = ["RULE", "STAGES", "GateSettings", "TuneConfig", "run"]
