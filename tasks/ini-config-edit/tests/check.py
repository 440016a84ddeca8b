import configparser

cp = configparser.ConfigParser()
assert cp.read("/app/app.ini") == ["/app/app.ini"], "cannot read /app/app.ini"
assert cp.sections() == ["server", "database"], cp.sections()
assert dict(cp["server"]) == {"host": "0.0.0.0", "port": "9090", "workers": "4", "debug": "false"}, dict(cp["server"])
assert dict(cp["database"]) == {"host": "db.internal", "port": "5432", "name": "furlong"}, dict(cp["database"])
print("ok")
