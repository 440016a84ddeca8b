#!/bin/bash
id -un > /home/app/whoami.txt
