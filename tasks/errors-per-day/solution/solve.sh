#!/bin/bash
awk '$2 == "ERROR" {print substr($1, 1, 10)}' /app/app.log | sort | uniq -c | awk '{print $2, $1}' > /app/errors_per_day.txt
