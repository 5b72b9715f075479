import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the `exact_checks` helper module, under any import mode
