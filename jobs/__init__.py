"""Backlot's job platform: @job, retry policies, the job ledger, dead letters, rate limits."""
