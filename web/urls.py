"""The site's own pages: the home page at "/"."""

from django.urls import path

from . import views

urlpatterns = [
    path("", views.home, name="home"),
]
