#!/bin/bash
# /tmp, not app's home: the home's owner is the image's (as an ordinary user furlong keeps no image
# owners, docs/images.md), and this task is about who the agent runs as
id -un > /tmp/whoami.txt
