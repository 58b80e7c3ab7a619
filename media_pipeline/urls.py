"""Pages of media_pipeline: the video list with its upload form, a video, a rendition's file and
its poster frame."""

from django.urls import path

from . import views

app_name = "media_pipeline"
urlpatterns = [
    path("", views.video_list, name="video_list"),
    path("<uuid:video_id>/", views.video_detail, name="video_detail"),
    path("<uuid:video_id>/cancel", views.video_cancel, name="video_cancel"),
    path(
        "<uuid:video_id>/renditions/<str:format>/",
        views.rendition_download,
        name="rendition_download",
    ),
    path(
        "<uuid:video_id>/renditions/<str:format>/poster.jpg",
        views.rendition_poster,
        name="rendition_poster",
    ),
]
