from django.urls import path

from jobs.web import views

urlpatterns = [
    path("health/", views.health, name="health"),
    path("metrics", views.metrics, name="metrics"),
    path("jobs/", views.job_list_page, name="job_list"),
    path("jobs/<uuid:job_id>/", views.job_page, name="job_page"),
    path("jobs/<uuid:job_id>/cancel", views.job_cancel_page, name="job_cancel_page"),
]
