#!/bin/bash
{ /srv/app/bin/appinfo; cat /srv/app/data/seed.txt; } > /srv/app/report.txt
