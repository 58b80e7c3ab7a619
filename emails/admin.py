"""Admin for messages, campaigns and imports (history is read-only; addresses masked)."""

from __future__ import annotations

from django.contrib import admin

from jobs import ReadOnlyAdmin, mask_email

from .models import Campaign, CampaignRecipient, EmailMessage, RecipientImport


@admin.register(EmailMessage)
class EmailMessageAdmin(ReadOnlyAdmin):
    list_display = (
        "pk",
        "masked_to",
        "subject",
        "template",
        "status",
        "attempts",
        "created_at",
        "sent_at",
    )
    list_filter = ("status", "template")
    search_fields = ("=uid", "=job_id")
    exclude = ("to", "context")
    show_full_result_count = False

    @admin.display(description="to")
    def masked_to(self, obj: EmailMessage) -> str:
        return mask_email(obj.to)


@admin.register(Campaign)
class CampaignAdmin(ReadOnlyAdmin):
    list_display = ("name", "status", "template", "created_at", "started_at")
    list_filter = ("status",)


@admin.register(CampaignRecipient)
class CampaignRecipientAdmin(ReadOnlyAdmin):
    list_display = ("pk", "campaign", "masked_email")
    list_filter = ("campaign",)
    exclude = ("email", "name", "data")

    @admin.display(description="email")
    def masked_email(self, obj: CampaignRecipient) -> str:
        return mask_email(obj.email)


@admin.register(RecipientImport)
class RecipientImportAdmin(ReadOnlyAdmin):
    list_display = (
        "pk",
        "campaign",
        "status",
        "rows_read",
        "imported",
        "duplicates",
        "skipped",
        "created_at",
    )
    list_filter = ("status",)
