"""jobs.OwnedQuerySet as the email apps use it: own rows, all for active staff, none anonymous."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import AnonymousUser

from emails.models import EmailMessage

pytestmark = pytest.mark.django_db


def test_visible_to_own_rows_all_for_active_staff_none_for_anonymous(django_user_model):
    # given two users' messages and a staff member
    ann = django_user_model.objects.create_user("ann", password="x")
    bob = django_user_model.objects.create_user("bob", password="x")
    staff = django_user_model.objects.create_user("staff", password="x", is_staff=True)
    mine = EmailMessage.objects.create(to="a@example.com", subject="s", template="t", owner=ann)
    EmailMessage.objects.create(to="b@example.com", subject="s", template="t", owner=bob)

    # then each sees what they may
    assert list(EmailMessage.objects.visible_to(ann)) == [mine]
    assert EmailMessage.objects.visible_to(staff).count() == 2
    assert not EmailMessage.objects.visible_to(AnonymousUser()).exists()
    assert not EmailMessage.objects.visible_to(None).exists()
    staff.is_active = False  # a deactivated staff member keeps no view of everyone's rows
    assert not EmailMessage.objects.visible_to(staff).exists()
