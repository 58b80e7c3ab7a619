"""Job arguments must be small plain JSON; a bad payload is refused before anything is written."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import re

import pytest

from jobs.broker.queues import queue_keys as broker_queue_keys
from jobs.broker.redis import redis_client
from jobs.core.exceptions import InvalidPayload, PayloadTooLarge
from jobs.core.payload import payload_check
from jobs.models import Job
from tests.support import tasks


def check(*args: object, max_bytes: int = 64 * 1024, **kwargs: object) -> int:
    return payload_check(task_name="emails.send", args=args, kwargs=kwargs, max_bytes=max_bytes)


class Recipient:
    pass


# --- payload_check -------------------------------------------------------------------------


def test_plain_json_is_accepted_and_its_size_returned():
    args = (42, "x@example.com", 1.5, True, None, [1, [2, 3]], {"a": {"b": [None]}})
    kwargs = {"when": "2025-01-01T00:00:00Z", "ids": [1, 2, 3]}

    size = payload_check(task_name="t", args=args, kwargs=kwargs, max_bytes=10_000)

    assert size == len(json.dumps([list(args), kwargs], separators=(",", ":")).encode())


def test_empty_payload_is_accepted():
    assert check() == len(b"[[],{}]")


def test_size_is_measured_as_sent_with_non_ascii_escaped():
    # Celery's JSON (kombu) escapes non-ASCII, so "é" travels as the 6 bytes \u00e9
    assert check("é") == len(b'[["\\u00e9"],{}]')


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (dt.datetime(2025, 1, 1, 12, 0), "datetime.datetime"),
        (dt.date(2025, 1, 1), "datetime.date"),
        (decimal.Decimal("1.10"), "decimal.Decimal"),
        (Recipient(), "Recipient"),
        ({1, 2}, "builtins.set"),
        (b"\x00raw", "builtins.bytes"),
    ],
)
def test_non_json_positional_argument_is_named_with_its_type(value, type_name):
    with pytest.raises(InvalidPayload) as error:
        check(1, value)

    message = str(error.value)
    assert message.startswith("Cannot enqueue emails.send: args[1] is a ")
    assert type_name in message
    assert "not JSON-serializable" in message


@pytest.mark.parametrize(
    ("kwargs", "path", "type_name"),
    [
        ({"when": dt.datetime(2025, 1, 1)}, "kwargs['when']", "datetime.datetime"),
        ({"opts": {"tags": {"a"}}}, "kwargs['opts']['tags']", "builtins.set"),
        ({"rows": [1, {"blob": b"x"}]}, "kwargs['rows'][1]['blob']", "builtins.bytes"),
        ({"who": [Recipient()]}, "kwargs['who'][0]", "Recipient"),
    ],
)
def test_non_json_value_nested_in_kwargs_is_named_by_its_path(kwargs, path, type_name):
    with pytest.raises(InvalidPayload) as error:
        check(**kwargs)

    message = str(error.value)
    assert f"{path} is a " in message
    assert type_name in message


def test_first_offending_value_is_reported():
    with pytest.raises(InvalidPayload, match=re.escape("args[0] is a builtins.set")):
        check({1}, b"x", when=dt.date.today())


def test_tuples_are_accepted_as_json_arrays():
    assert check((1, 2)) == len(b"[[[1,2]],{}]")


@pytest.mark.parametrize("key", [1, None, ("a", "b")])
def test_non_string_dict_key_is_rejected(key):
    with pytest.raises(InvalidPayload) as error:
        check(mapping={key: "v"})

    message = str(error.value)
    assert f"kwargs['mapping'] has a non-string key {key!r} ({type(key).__name__})" in message


@pytest.mark.parametrize(
    ("value", "shown"), [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")]
)
def test_nan_and_infinity_are_rejected(value, shown):
    with pytest.raises(InvalidPayload) as error:
        check(ratio=[0.5, value])

    assert f"kwargs['ratio'][1] is {shown}, which JSON cannot represent" in str(error.value)


def test_oversized_payload_names_its_size_and_the_limit():
    args = ("x" * 200,)
    size = len(json.dumps([list(args), {}], separators=(",", ":")).encode())

    with pytest.raises(PayloadTooLarge) as error:
        check(*args, max_bytes=size - 1)

    message = str(error.value)
    assert f"arguments are {size} bytes as JSON, over the {size - 1}-byte limit" in message
    assert "MAX_PAYLOAD_BYTES" in message
    assert isinstance(error.value, InvalidPayload)


def test_payload_exactly_at_the_limit_is_accepted():
    size = check("x" * 200)
    assert check("x" * 200, max_bytes=size) == size


# --- enqueue refuses before writing or sending ---------------------------------------------


def broker_messages() -> int:
    client = redis_client()
    return sum(
        client.llen(key) for key in broker_queue_keys("reports")
    )  # no session worker drains it


@pytest.fixture
def small_payloads(settings):
    settings.BACKLOT = {**settings.BACKLOT, "MAX_PAYLOAD_BYTES": 200}


@pytest.mark.django_db(transaction=True)
def test_enqueue_with_a_non_json_argument_writes_and_sends_nothing(clean_redis):
    with pytest.raises(InvalidPayload, match=re.escape("kwargs['label'] is a datetime.datetime")):
        # a wrong type on purpose: mypy sees it too; the platform must refuse it at run time
        tasks.prioritized.enqueue("payload", label=dt.datetime(2025, 1, 1))  # type: ignore[arg-type]

    assert Job.objects.count() == 0
    assert broker_messages() == 0


@pytest.mark.django_db(transaction=True)
def test_enqueue_over_the_size_limit_writes_and_sends_nothing(clean_redis, small_payloads):
    with pytest.raises(PayloadTooLarge, match="over the 200-byte limit"):
        tasks.prioritized.enqueue("payload", label="x" * 500)

    assert Job.objects.count() == 0
    assert broker_messages() == 0


@pytest.mark.django_db(transaction=True)
def test_valid_enqueue_is_written_and_sent(clean_redis, small_payloads):
    # the control for the two tests above: the same job with a good payload does arrive
    handle = tasks.prioritized.enqueue("payload", label="ok")

    assert Job.objects.filter(id=handle.id, task_name="tests.prioritized").exists()
    assert broker_messages() == 1
