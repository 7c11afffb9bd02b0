"""Every test tier (tests/, services/*/tests/, libs/*/tests/) shares the fixtures of the test-support package."""

pytest_plugins = ["examlops_testsupport.plugin"]
