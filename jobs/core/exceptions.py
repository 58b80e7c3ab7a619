"""The exceptions Backlot raises to callers; all derive from BacklotError."""


class BacklotError(Exception):
    """Base class of every error the platform raises on purpose."""


class InvalidPayload(BacklotError, ValueError):
    """Job arguments that cannot be sent: not JSON, or too large."""


class PayloadTooLarge(InvalidPayload):
    """Serialized arguments are over the size cap (BACKLOT['MAX_PAYLOAD_BYTES'])."""


class InvalidArguments(BacklotError, TypeError):
    """Job arguments that do not fit the job's signature (a mistyped call); nothing was
    enqueued. A TypeError, as calling the function with them would raise."""


class UnknownTask(BacklotError, LookupError):
    """A task name that no installed module registers (e.g. replaying a removed job)."""


class ReplayError(BacklotError):
    """A dead letter that cannot be replayed in its current state."""


class BrokerUnavailable(BacklotError):
    """The broker did not take a message that has no ledger row to wait in (track=False)."""


class AlreadyFinished(BacklotError):
    """A job that has ended (succeeded, dead, cancelled) cannot be cancelled."""

    def __init__(self, job_id: str, state: str) -> None:
        super().__init__(f"Job {job_id} already finished: it is {state}")
        self.job_id = job_id
        self.state = state


class JobCancelled(BacklotError):
    """Raised inside a running job by self.progress() once it was asked to stop: the run ends
    cancelled (no retry, no dead letter). A job may catch it to clean up, then re-raise."""


class LeaseLost(BacklotError):
    """Raised inside a running job whose run no longer holds its claim: its lease lapsed (its
    renewals failed, its process was stopped) or another run took the job over. The run's
    progress, effects and finish are refused; the job's current run decides its outcome.
    A job may catch it to clean up, then re-raise."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"Job {job_id}: this run lost its claim ({reason})")
        self.job_id = job_id
        self.reason = reason


class StepOrderChanged(BacklotError):
    """A job asked for its steps in another order than its stored history (its code changed
    between runs, or a step's name is not deterministic): the job gives up (no retry) rather
    than hand a step another step's stored result."""


class StepResultTooLarge(PayloadTooLarge):
    """A step returned a value over BACKLOT['MAX_PAYLOAD_BYTES'] as JSON, or not JSON at all:
    store the data elsewhere and return its id."""


class StepTimeout(BacklotError):
    """Raised by self.wait_for() when its timeout passed before the event was signalled; the
    job may catch it (a later run raises it again at the same place, as its history says)."""


class SignalRefused(BacklotError):
    """jobs.signal() refused the event: the job already got a signal of that name (the first
    wins), or it has finished."""
