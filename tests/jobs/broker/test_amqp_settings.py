"""RabbitMQ as the broker, as a host configures it: an amqp:// CELERY_BROKER_URL (or
BACKLOT['BROKER_URL']) gives the workers quorum queues, publisher confirms and no broker-side
countdowns; bad values fail with an error naming them; Redis stays required."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs.broker import amqp, broker, queues
from jobs.core.conf import backlot_settings
from jobs.web.checks import check_celery_settings, check_conflicting_celery_settings
from jobs.worker.celery import platform_settings, platform_transport_options
from jobs.worker.consumer import DELAYED_DELIVERY, Consumer

RABBIT = "amqp://backlot:s3cret@rabbit.example:5672/jobs"


@pytest.fixture
def on_rabbitmq(settings):
    settings.CELERY_BROKER_URL = RABBIT
    settings.REDIS_URL = "redis://127.0.0.1:6390/0"
    return settings


def test_an_amqp_celery_broker_url_makes_rabbitmq_the_broker_and_keeps_redis(on_rabbitmq):
    conf = backlot_settings()

    assert conf.BROKER_URL == RABBIT
    assert conf.REDIS_URL == "redis://127.0.0.1:6390/0"  # limits, gates, counters, beat's lock
    assert amqp.enabled()
    assert platform_settings()["broker_url"] == RABBIT
    assert check_conflicting_celery_settings() == []
    assert [p.id for p in check_celery_settings()] == []


def test_backlots_queues_on_rabbitmq_are_durable_quorum_queues_that_dead_letter(on_rabbitmq):
    queues = {queue.name: queue for queue in platform_settings()["task_queues"]}

    assert set(queues) == set(backlot_settings().QUEUES)
    for name, queue in queues.items():
        assert queue.durable and queue.exchange.name == name and queue.routing_key == name
        assert queue.queue_arguments == {
            "x-queue-type": "quorum",
            "x-delivery-limit": 20,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": amqp.UNDELIVERABLE,
        }
    assert platform_transport_options() == {"confirm_publish": True}
    # no native delayed delivery: delays wait in the ledger
    assert platform_settings()["worker_consumer"] == "jobs.worker.consumer:Consumer"
    assert DELAYED_DELIVERY not in Consumer.Blueprint.default_steps


def test_classic_queues_carry_backlots_priorities(on_rabbitmq):
    on_rabbitmq.BACKLOT = {**on_rabbitmq.BACKLOT, "AMQP_QUEUE_TYPE": "classic"}

    queue = platform_settings()["task_queues"][0]

    assert queue.queue_arguments == {"x-max-priority": 9}
    assert [broker.broker_priority(p) for p in (0, 5, 9)] == [0, 5, 9]  # higher first


def test_on_rabbitmq_only_a_job_due_now_goes_to_the_broker_and_rows_wait_for_the_confirm(
    on_rabbitmq,
):
    assert broker.takes_countdown(0) and not broker.takes_countdown(1)
    assert not broker.lists_held_messages()
    assert queues.held_job_ids("default") is None  # RabbitMQ cannot show what it holds


def test_on_redis_the_countdown_and_priorities_are_as_before(settings):
    assert not amqp.enabled()
    assert broker.takes_countdown(900) and not broker.takes_countdown(901)
    assert broker.lists_held_messages()
    assert [broker.broker_priority(p) for p in (0, 9)] == [9, 0]  # Redis pops level 0 first
    assert "confirm_publish" not in platform_transport_options()


def test_rabbitmq_without_a_redis_fails_check(settings):
    settings.CELERY_BROKER_URL = RABBIT
    del settings.REDIS_URL

    problems = check_celery_settings()

    assert [p.id for p in problems] == ["jobs.E012"]
    assert "REDIS_URL" in problems[0].hint and "s3cret" not in problems[0].msg


@pytest.mark.parametrize(
    ("backlot", "says"),
    [
        ({"BROKER_URL": "sqs://key:s3cret@"}, "scheme 'sqs'"),
        ({"AMQP_QUEUE_TYPE": "mirrored"}, "'quorum' or 'classic'"),
        ({"BROKER_URL": "redis://other.example:6379/0"}, "another Redis than REDIS_URL"),
    ],
)
def test_a_bad_broker_setting_is_an_error_naming_it(settings, backlot, says):
    settings.BACKLOT = {**settings.BACKLOT, **backlot}

    with pytest.raises(ImproperlyConfigured) as raised:
        backlot_settings()

    assert says in str(raised.value) and "s3cret" not in str(raised.value)


def test_a_redis_celery_broker_beside_a_rabbitmq_backlot_broker_is_a_conflict(settings):
    settings.BACKLOT = {**settings.BACKLOT, "BROKER_URL": RABBIT}
    settings.CELERY_BROKER_URL = settings.REDIS_URL

    found = check_conflicting_celery_settings()

    assert [(p.id, p.obj) for p in found] == [("jobs.E010", "CELERY_BROKER_URL")]
    assert "names RabbitMQ" in found[0].msg


def test_the_reference_settings_name_no_old_style_celery_broker_setting(settings):
    # BROKER_URL in Django's settings is Celery's old name for broker_url: even empty it would
    # count as the project's choice (jobs.worker.celery._set_by_project), and with Redis
    # Sentinels (no CELERY_BROKER_URL) Celery would fall back to amqp://localhost.
    assert not hasattr(settings, "BROKER_URL")
    assert settings.CELERY_BROKER_URL == settings.REDIS_URL


def test_a_nacked_or_refused_publish_is_a_broker_error_that_leaves_the_row_in_the_outbox():
    from amqp.exceptions import ConnectionForced, MessageNacked

    assert issubclass(MessageNacked, broker.BROKER_ERRORS)  # a quorum queue electing a leader
    assert issubclass(ConnectionForced, broker.BROKER_ERRORS)  # the node shut down


def test_a_priority_read_back_from_a_rabbitmq_message_is_backlots_own(on_rabbitmq):
    # jobs.worker.request reads request.delivery_info['priority'] back through backlot_priority
    assert [broker.backlot_priority(broker.broker_priority(p)) for p in range(10)] == list(
        range(10)
    )
    assert broker.backlot_priority(7) == 7


def test_rabbitmq_s_reason_for_a_dead_lettered_message_is_read(on_rabbitmq):
    assert amqp.death_reason({"x-first-death-reason": "expired"}) == "expired"
    assert amqp.death_reason({"x-death": [{"reason": "delivery_limit", "count": 1}]}) == (
        "delivery_limit"
    )
    assert amqp.death_reason({}) == "delivery_limit"


def test_adopted_celery_priorities_keep_the_order_they_had_on_their_broker(settings):
    from jobs.flow.adopt import backlot_priority

    assert [backlot_priority(level) for level in (0, 9, 12)] == [9, 0, 0]  # Redis: 0 first
    settings.CELERY_BROKER_URL = RABBIT
    settings.REDIS_URL = "redis://127.0.0.1:6390/0"
    assert [backlot_priority(level) for level in (0, 9, 12)] == [0, 9, 9]  # RabbitMQ: 9 first
