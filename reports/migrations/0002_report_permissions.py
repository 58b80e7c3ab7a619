# Who may ask for what: a permission per report kind, and one to email reports to others.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("reports", "0001_initial"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="report",
            options={
                "ordering": ("-created_at", "-id"),
                "permissions": [
                    ("request_sales_report", "Can request the sales report"),
                    ("request_operations_report", "Can request the job operations report"),
                    ("email_report_elsewhere", "Can have reports emailed to other addresses"),
                ],
                "verbose_name": "report",
                "verbose_name_plural": "reports",
            },
        ),
    ]
