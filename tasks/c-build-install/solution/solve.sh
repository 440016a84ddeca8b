#!/bin/bash
make -C /app/src install
