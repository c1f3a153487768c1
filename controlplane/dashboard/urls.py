from django.urls import path

from controlplane.dashboard import views

app_name = "dashboard"

urlpatterns = [
    path("", views.release_list, name="release-list"),
    path("releases/<int:release_id>/", views.release_detail, name="release-detail"),
    path(
        "releases/<int:release_id>/approve/",
        views.approve_release,
        name="approve-release",
    ),
    path(
        "releases/<int:release_id>/reject/", views.reject_release, name="reject-release"
    ),
    path(
        "environments/<int:environment_id>/rollback/",
        views.rollback_environment,
        name="rollback-environment",
    ),
]
