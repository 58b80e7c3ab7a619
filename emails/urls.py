"""Pages of emails."""

from django.urls import path

from . import views

app_name = "emails"
urlpatterns = [
    path("", views.index, name="index"),
    path("campaigns/", views.campaign_create, name="campaign_create"),
    path("campaigns/<int:campaign_id>/", views.campaign_detail, name="campaign"),
    path("campaigns/<int:campaign_id>/start", views.campaign_start, name="campaign_start"),
    path("campaigns/<int:campaign_id>/cancel", views.campaign_cancel, name="campaign_cancel"),
]
