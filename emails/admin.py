"""Admin for messages, campaigns and imports (history is read-only; addresses masked)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from jobs.masking import mask_email

from .models import Campaign, CampaignRecipient, EmailMessage, RecipientImport


class ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(EmailMessage)
class EmailMessageAdmin(ReadOnly):
    list_display = ("pk", "masked_to", "subject", "template", "status", "attempts", "created_at", "sent_at")
    list_filter = ("status", "template")
    search_fields = ("=uid", "=job_id")
    exclude = ("to", "context")
    show_full_result_count = False

    @admin.display(description="to")
    def masked_to(self, obj: EmailMessage) -> str:
        return mask_email(obj.to)


@admin.register(Campaign)
class CampaignAdmin(ReadOnly):
    list_display = ("name", "status", "template", "created_at", "started_at")
    list_filter = ("status",)


@admin.register(CampaignRecipient)
class CampaignRecipientAdmin(ReadOnly):
    list_display = ("pk", "campaign", "masked_email")
    list_filter = ("campaign",)
    exclude = ("email", "name", "data")

    @admin.display(description="email")
    def masked_email(self, obj: CampaignRecipient) -> str:
        return mask_email(obj.email)


@admin.register(RecipientImport)
class RecipientImportAdmin(ReadOnly):
    list_display = ("pk", "campaign", "status", "rows_read", "imported", "duplicates", "skipped", "created_at")
    list_filter = ("status",)
