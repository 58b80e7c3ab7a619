from django.contrib import admin
from django.urls import include, path

from .api import api

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    path("api/", api.urls),
    path("emails/", include("emails.urls")),
    path("reports/", include("reports.urls")),
    path("videos/", include("media_pipeline.urls")),
    path("", include("jobs.web.urls")),
    path("", include("web.urls")),
]
