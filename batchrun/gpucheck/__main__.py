"""`python -m batchrun.gpucheck`; exit status 1 when a section failed (its error is in the JSON)."""
from batchrun.gpucheck import main

result = main()
raise SystemExit(1 if any("error" in s for s in result["sections"].values()) else 0)
