"""Security suite (issue 5, "Security suite"): where each requirement is tested.

In this folder:
- Session-authenticated API POSTs without a valid CSRF token are 403 and write nothing; with
  the token they are accepted; a bearer token works with no session and no CSRF token; a junk
  Authorization header does not skip the check: test_csrf.py.
- Redis password honoured when REDIS_URL has one (publish works with it; a wrong one leaves
  the job in the outbox, fast, and the relay sends it once the password is right; Redis
  refuses clients without it): test_redis_password.py.
- No email address, password, token or name in any worker log of the whole test run: the
  end-of-session scan in conftest.py (fails the session, printing file:line masked), plus
  test_logs.py, which shows a worker logs a refused address masked and that the scan fails on
  a raw one.
- JSON API fuzzed with schemathesis against /api/openapi.json (no 5xx, documented answers
  match the schema), and each documented answer checked with real objects: test_api_fuzz.py.

Elsewhere:
- A pickled message pushed raw into a queue is refused and never run:
  tests/jobs/worker/test_delivery.py::test_pickled_message_is_refused_and_not_executed.
- Flower without credentials is 401 (and answers with them):
  tests/system/test_flower.py::test_refuses_requests_without_valid_credentials.
- Admin replay/discard without the permission is 403 (forged action POSTs and the replay
  views): tests/jobs/admin/test_admin.py::test_without_permission_no_actions_and_forged_post_is_403.
- Other users' objects are 404 (staff see them):
  job status: tests/jobs/web/test_api.py::test_other_user_gets_404;
  report status and download: tests/reports/test_api.py::
  test_status_and_download_are_for_owner_and_staff_only;
  video status: tests/media_pipeline/test_api.py::test_another_users_video_is_404_and_staff_see_it;
  video page and rendition download: tests/media_pipeline/test_pages.py::
  test_video_page_is_for_the_owner_and_staff and
  test_rendition_download_is_404_for_others_and_unfinished_formats.
  Not covered anywhere yet: emails, campaigns and recipient imports of other users
  (emails/api.py `_owned`).
- Payload limits with a clear 4xx message: tests/jobs/core/test_payload.py (size limit naming the
  size and MAX_PAYLOAD_BYTES, non-JSON values named by path; nothing written or sent).
- Upload limits: video uploads over BACKLOT_MAX_UPLOAD_BYTES are 413 and store nothing:
  tests/media_pipeline/test_api.py::test_an_oversized_upload_is_413_and_nothing_is_stored,
  test_a_file_of_exactly_the_limit_is_accepted, and the page upload in
  tests/media_pipeline/test_pages.py::test_page_upload_over_the_limit_is_413_with_the_reason.
  Not covered yet: the 413 of the CSV recipient import (emails/api.py `recipients_import`).
- Client file names never become paths: tests/media_pipeline/test_services.py::
  test_display_name_keeps_only_a_printable_base_name ("../../etc/passwd" -> "passwd") and
  test_video_create_stores_under_a_generated_name_and_enqueues; format names with "../" are
  400: tests/media_pipeline/test_api.py::
  test_a_bad_format_is_400_naming_the_field_and_nothing_is_enqueued. (CSV imports are stored
  under a generated name, emails/services.py `recipients_import_create`, untested.)
"""
