#!/bin/bash
sed -i 's/^port = 8080$/port = 9090\ndebug = false/' /app/app.ini
