#!/bin/bash
cat /app/logs/*.log | grep -c ERROR > /app/errors.txt
