"""Pages of reports."""

from django.urls import path

from . import views

app_name = "reports"
urlpatterns = [
    path("", views.report_list, name="list"),
    path("<int:report_id>/", views.report_page, name="detail"),
    path("<int:report_id>/cancel", views.report_cancel, name="cancel"),
]
