"""The reference project's site pieces that are not about jobs: API tokens, upload limits, log
formatters, the home page, admin bootstrap commands."""
