"""Names of the trailing metadata that carry an error's machine-readable reason and field."""

REASON_KEY = "examlops-reason"
PARAM_KEY = "examlops-param"
