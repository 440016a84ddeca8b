#!/bin/bash
cut -d= -f2 /home/worker/settings.ini | paste -sd, - > /data/values.txt
