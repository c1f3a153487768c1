from django.contrib import admin

from controlplane.webhooks.models import Webhook, WebhookDelivery


@admin.register(Webhook)
class WebhookAdmin(admin.ModelAdmin):
    list_display = ("url", "environment", "active", "created")
    list_filter = ("active",)
    # Created through the API, which shows the secret once; never shown here.
    exclude = ("secret_ciphertext",)
    readonly_fields = ("environment", "url", "created")

    def has_add_permission(self, request):
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("event", "webhook", "state", "attempts", "last_status", "created")
    list_filter = ("state",)
    readonly_fields = [f.name for f in WebhookDelivery._meta.fields]

    def has_add_permission(self, request):
        return False
